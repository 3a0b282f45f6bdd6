//! Errors of the CUDA backend.

/// Result with [`CudaError`].
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Everything that can go wrong on the CUDA side.
#[allow(missing_docs)]
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "{0} could not be loaded (is the CUDA driver / NVRTC installed and on LD_LIBRARY_PATH?)"
    )]
    NoLibrary(&'static str),
    #[error("{call} failed for module {module}: {code}")]
    Nvrtc {
        call: &'static str,
        module: String,
        code: String,
    },
    #[error("compiling kernel module {module} failed:\n{log}")]
    Compile { module: String, log: String },
    #[error("CUDA: {op}: {msg}")]
    Driver { op: String, msg: String },
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoDevice { ordinal: usize, count: usize },
    #[error(
        "the model does not fit on {device}: it needs {need_mib} MiB of weights, the device has {free_mib} MiB free of {total_mib} MiB"
    )]
    DoesNotFit {
        device: String,
        need_mib: u64,
        free_mib: u64,
        total_mib: u64,
    },
    #[error(
        "a VRAM budget of {budget_mib} MiB is too small: the trunk needs {trunk_mib} MiB, the KV cache and activations {reserve_mib} MiB, the two prefill staging slots {staging_mib} MiB and one token's {used} experts in every layer {slots_mib} MiB"
    )]
    Budget {
        budget_mib: u64,
        trunk_mib: u64,
        reserve_mib: u64,
        staging_mib: u64,
        slots_mib: u64,
        used: usize,
    },
    #[error(
        "{tensor}: no CUDA kernel for {ty} weights (have: {})",
        crate::backend::format_names()
    )]
    Unsupported { tensor: String, ty: String },
}

impl From<CudaError> for samesum_engine::EngineError {
    fn from(e: CudaError) -> Self {
        samesum_engine::EngineError::Device {
            backend: "cuda",
            op: match &e {
                CudaError::Driver { op, .. } => op.clone(),
                _ => "setup".into(),
            },
            msg: e.to_string(),
        }
    }
}
