//! Which backend a model runs on, and opening it: a [`Device`] names the
//! backend and its options, [`AnyBackend::open`] makes it, and
//! [`with_backend!`](crate::with_backend) runs code generic over
//! [`Backend`] on it. Every command that runs a model opens its backend
//! here; `samesum serve` hands its [`Device`] to the server as the model
//! thread's [`OpenBackend`].

pub(crate) use samesum_cuda::{Cuda, CudaOptions};
pub(crate) use samesum_engine::cpu::Cpu;
use samesum_engine::{Backend, Model};
use samesum_server::{Memory, ModelThread, OpenBackend, Opened};

/// A backend and its options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Device {
    /// The CPU backend with this many threads (0: all cores).
    Cpu(usize),
    /// CUDA device N, with its placement and attention options (a VRAM
    /// budget for tier mode, `None`: resident when the model fits, tier mode
    /// by itself when it does not).
    Cuda(usize, CudaOptions),
}

/// A device name that is not `cpu`, `cuda`, `gpu` or `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ParseDeviceError(String);

impl std::str::FromStr for Device {
    type Err = ParseDeviceError;

    /// `cpu` (all cores), `cuda` or `gpu` (device 0), or `cuda:N`, in any
    /// case; CUDA with the default options.
    fn from_str(s: &str) -> Result<Device, ParseDeviceError> {
        let s = s.trim().to_ascii_lowercase();
        let cuda = |n| Ok(Device::Cuda(n, CudaOptions::default()));
        if s == "cpu" {
            Ok(Device::Cpu(0))
        } else if s == "cuda" || s == "gpu" {
            cuda(0)
        } else if let Some(n) = s.strip_prefix("cuda:") {
            match n.parse() {
                Ok(i) => cuda(i),
                Err(_) => Err(ParseDeviceError(format!(
                    "{s:?}: expected cuda:N with N a device number"
                ))),
            }
        } else {
            Err(ParseDeviceError(format!(
                "{s:?} is not supported (cpu, cuda, cuda:N)"
            )))
        }
    }
}

/// The default prompt rows per batched call on CUDA (qwen35moe pp4096 on
/// the H200: 6,576 tok/s at 512, 7,005 at 1024, 7,164 at 2048).
pub(crate) const CUDA_CHUNK: usize = 2048;
/// The default on CUDA in tier mode: the size its activations were measured
/// at inside a VRAM budget.
pub(crate) const CUDA_TIER_CHUNK: usize = 512;
/// `samesum serve`'s default prompt rows per scheduler step on CUDA. A step
/// also carries every running request's next decode row, so a prefill step
/// delays their tokens (2,048 rows are ~110 ms of qwen35moe on an H100), but
/// each step pays the decode rows' time once: with 64 streams of 512-token
/// prompts, 2,048 rows a step generated 1,723 and 1,695 tok/s with TTFT p99
/// 2.02 s, against 1,548 and 2.98 s at 512 rows (docs/BENCHMARKS.md). The
/// budget is a cap: a lone prompt of 512 tokens still takes one step of its
/// own size.
pub(crate) const CUDA_SERVE_CHUNK: usize = 2048;
/// `samesum serve`'s default on the CPU.
pub(crate) const CPU_SERVE_CHUNK: usize = 128;

impl Device {
    /// Prompt rows per scheduler step of `samesum serve` by default (any
    /// value computes the same bytes; it trades a prompt's prefill speed
    /// against the other requests' token latency).
    pub(crate) fn serve_chunk(self) -> usize {
        match self {
            Device::Cpu(_) => CPU_SERVE_CHUNK,
            Device::Cuda(..) => CUDA_SERVE_CHUNK,
        }
    }
}

/// An open backend: the CPU or a CUDA device with the model's weights
/// placed. Run generic code on it with [`with_backend!`](crate::with_backend).
pub(crate) enum AnyBackend {
    /// The CPU backend.
    Cpu(Cpu),
    /// A CUDA device (boxed: it is far larger than the CPU backend).
    Cuda(Box<Cuda>),
}

impl AnyBackend {
    /// Open `device` for `model`: on CUDA, upload its weights (with
    /// progress bars when `progress` is set); errors say what is missing
    /// (driver, NVRTC, device, memory).
    pub(crate) fn open(
        device: Device,
        model: &Model,
        progress: bool,
    ) -> Result<AnyBackend, samesum_cuda::CudaError> {
        Ok(match device {
            Device::Cpu(threads) => AnyBackend::Cpu(Cpu::new(threads)),
            Device::Cuda(n, opts) => {
                AnyBackend::Cuda(Box::new(Cuda::with_options(n, model, progress, opts)?))
            }
        })
    }

    /// A CUDA device's free and total memory now (`None` on the CPU, or
    /// when the driver does not say).
    pub(crate) fn device_memory(&self) -> Option<(u64, u64)> {
        match self {
            AnyBackend::Cpu(_) => None,
            AnyBackend::Cuda(c) => c.memory_info().ok(),
        }
    }

    /// The backend's name (as [`Backend::name`]).
    pub(crate) fn name(&self) -> String {
        match self {
            AnyBackend::Cpu(c) => c.name(),
            AnyBackend::Cuda(c) => c.name(),
        }
    }

    /// Where the weights went, for a CUDA backend opened in `load_secs`
    /// seconds: resident, or tier mode's split between VRAM and host memory.
    /// `None` on the CPU.
    pub(crate) fn placement(&self, load_secs: f64) -> Option<String> {
        let AnyBackend::Cuda(c) = self else {
            return None;
        };
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        Some(match c.tier_stats() {
            None => format!(
                "{}: {:.2} GiB of weights resident in {load_secs:.2}s",
                c.name(),
                gib(c.resident_bytes() as u64),
            ),
            Some((plan, _, pinned)) => format!(
                "{}: tier mode, {:.2} GiB in VRAM (trunk {:.2} GiB, {} expert slots per layer, two staging buffers of {:.2} GiB), {:.2} GiB of experts in {} host memory, in {load_secs:.2}s",
                c.name(),
                gib(c.resident_bytes() as u64),
                gib(plan.sizes.trunk),
                plan.slots,
                gib(plan.sizes.layer_experts()),
                gib(plan.sizes.layer_experts() * plan.sizes.layers as u64),
                if pinned {
                    "page-locked"
                } else {
                    "partly pageable"
                },
            ),
        })
    }

    /// Prompt rows per batched forward call by default: 256 on the CPU
    /// (measured best on the build machine), [`CUDA_CHUNK`] on CUDA,
    /// [`CUDA_TIER_CHUNK`] on CUDA in tier mode. Any chunk computes the same
    /// bytes.
    pub(crate) fn default_chunk(&self) -> usize {
        match self {
            AnyBackend::Cpu(_) => samesum_engine::DEFAULT_CHUNK,
            AnyBackend::Cuda(c) if c.tier_stats().is_some() => CUDA_TIER_CHUNK,
            AnyBackend::Cuda(_) => CUDA_CHUNK,
        }
    }
}

impl OpenBackend for Device {
    /// Open the device on the model thread (on CUDA, placing the weights
    /// with progress bars) and serve on it.
    fn open_and_run(&self, model: &Model, thread: ModelThread<'_>) -> Result<(), String> {
        let t = std::time::Instant::now();
        let b = AnyBackend::open(*self, model, true).map_err(|e| e.to_string())?;
        let opened = Opened {
            name: b.name(),
            placement: b.placement(t.elapsed().as_secs_f64()),
            memory: match &b {
                AnyBackend::Cpu(_) => Memory::Host,
                AnyBackend::Cuda(_) => Memory::Device(b.device_memory()),
            },
            max_chunk: match &b {
                AnyBackend::Cuda(c) if c.tier_stats().is_some() => Some(CUDA_TIER_CHUNK),
                _ => None,
            },
        };
        crate::with_backend!(&b, |b| thread.run(b, opened));
        Ok(())
    }
}

/// Evaluate `$body` with `$b` bound to the backend inside `$backend` (a
/// `&AnyBackend`), as `&Cpu` or `&Cuda`: `$body` is compiled once for each,
/// so it may call functions generic over [`Backend`].
///
/// ```ignore
/// let backend = AnyBackend::open(device, &model, true)?;
/// let name = with_backend!(&backend, |b| generic_fn(b, &model));
/// ```
#[macro_export]
macro_rules! with_backend {
    ($backend:expr, |$b:ident| $body:expr) => {
        match $backend {
            $crate::backend::AnyBackend::Cpu(cpu) => {
                let $b: &$crate::backend::Cpu = cpu;
                $body
            }
            $crate::backend::AnyBackend::Cuda(cuda) => {
                let $b: &$crate::backend::Cuda = cuda;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::{AnyBackend, CudaOptions, Device};

    fn cuda(n: usize) -> Device {
        Device::Cuda(n, CudaOptions::default())
    }

    #[test]
    fn parses_device_names() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu(0)));
        assert_eq!("cuda".parse(), Ok(cuda(0)));
        assert_eq!("gpu".parse(), Ok(cuda(0)));
        assert_eq!(" CUDA:3 ".parse(), Ok(cuda(3)));
        for bad in ["cuda:x", "tpu", "cuda:", ""] {
            assert!(bad.parse::<Device>().is_err(), "{bad:?}");
        }
        let e = "tpu".parse::<Device>().unwrap_err().to_string();
        assert!(e.contains("cpu, cuda, cuda:N"), "{e}");
    }

    #[test]
    fn default_chunks_follow_the_device() {
        assert_eq!(Device::Cpu(0).serve_chunk(), 128);
        assert_eq!(cuda(0).serve_chunk(), 2048);
        let cpu = AnyBackend::Cpu(super::Cpu::new(1));
        assert_eq!(cpu.default_chunk(), samesum_engine::DEFAULT_CHUNK);
        assert!(cpu.placement(1.0).is_none());
    }
}
