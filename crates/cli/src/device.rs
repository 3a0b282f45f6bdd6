//! `--device cpu|cuda[:N]`: which backend a command runs on.

use anyhow::{Result, bail};

/// A parsed `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Device {
    /// The CPU backend.
    Cpu,
    /// CUDA device N, with a VRAM budget for tier mode and the attention
    /// choice.
    Cuda(usize, samesum_cuda::CudaOptions),
}

/// `--attention`: which attention passes a CUDA backend runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Attention {
    /// The default passes: CUDA cores, samesum's exact order.
    #[default]
    Exact,
    /// Opt-in: the score and value passes on tensor cores (3xTF32 with fp32
    /// accumulation). Not the same bytes as `exact` (another summation
    /// order), one function for decode and prefill (batched still equals
    /// replay); docs/CAPABILITIES.md has its agreement with `exact`.
    Fast,
}

impl Device {
    /// `cpu`, `cuda` (device 0) or `cuda:N`, and `--vram-budget` (CUDA only).
    pub(crate) fn parse(s: &str, vram_budget: Option<&str>) -> Result<Device> {
        let s = s.trim().to_ascii_lowercase();
        let budget = match vram_budget {
            None => None,
            Some(b) => Some(
                samesum_cuda::tier::parse_bytes(b)
                    .map_err(|e| anyhow::anyhow!("--vram-budget {e}"))?,
            ),
        };
        let ordinal = if s == "cpu" {
            if budget.is_some() {
                bail!("--vram-budget applies to --device cuda, not the CPU");
            }
            return Ok(Device::Cpu);
        } else if s == "cuda" || s == "gpu" {
            0
        } else if let Some(n) = s.strip_prefix("cuda:") {
            match n.parse() {
                Ok(i) => i,
                Err(_) => bail!("--device {s:?}: expected cuda:N with N a device number"),
            }
        } else {
            bail!("--device {s:?} is not supported (cpu, cuda, cuda:N)")
        };
        Ok(Device::Cuda(
            ordinal,
            samesum_cuda::CudaOptions {
                vram_budget: budget,
                fast_attention: false,
            },
        ))
    }

    /// The device with `--attention` applied (`fast` is CUDA only).
    pub(crate) fn with_attention(self, attention: Attention) -> Result<Device> {
        match (self, attention) {
            (d, Attention::Exact) => Ok(d),
            (Device::Cpu, Attention::Fast) => {
                bail!("--attention fast applies to --device cuda, not the CPU")
            }
            (Device::Cuda(n, opts), Attention::Fast) => Ok(Device::Cuda(
                n,
                samesum_cuda::CudaOptions {
                    fast_attention: true,
                    ..opts
                },
            )),
        }
    }

    /// Prompt rows per batched forward call when `--chunk` is not given:
    /// 256 on the CPU (measured best on the build machine), 2048 on CUDA
    /// (qwen35moe pp4096 on the H200: 6,576 tok/s at 512, 7,005 at 1024,
    /// 7,164 at 2048), 512 on CUDA in tier mode (`tiered`: the size its
    /// activations were measured at inside a VRAM budget). Any chunk
    /// computes the same bytes.
    pub(crate) fn default_chunk(self, tiered: bool) -> usize {
        match self {
            Device::Cpu => samesum_engine::DEFAULT_CHUNK,
            Device::Cuda(..) if tiered => CUDA_TIER_CHUNK,
            Device::Cuda(..) => CUDA_CHUNK,
        }
    }

    /// `samesum serve`'s prompt rows per scheduler step when `--chunk` is
    /// not given (any value computes the same bytes; it trades a prompt's
    /// prefill speed against the other requests' token latency).
    pub(crate) fn serve_chunk(self) -> usize {
        match self {
            Device::Cpu => CPU_SERVE_CHUNK,
            Device::Cuda(..) => CUDA_SERVE_CHUNK,
        }
    }
}

/// The default prompt rows per batched call on CUDA.
pub(crate) const CUDA_CHUNK: usize = 2048;
/// `samesum serve`'s default prompt rows per scheduler step on CUDA: a step
/// also carries every running request's next decode row, so a prefill step
/// delays their tokens; 512 rows is ~55 ms on the H200 (qwen35moe), against
/// ~220 ms for 2,048.
pub(crate) const CUDA_SERVE_CHUNK: usize = 512;
/// `samesum serve`'s default on the CPU.
pub(crate) const CPU_SERVE_CHUNK: usize = 128;
/// The default in tier mode.
pub(crate) const CUDA_TIER_CHUNK: usize = 512;

/// Open the CUDA backend for `model` on device `n`, uploading its weights with a
/// progress bar; errors say what is missing (driver, NVRTC, device, memory).
pub(crate) fn cuda(
    n: usize,
    opts: samesum_cuda::CudaOptions,
    model: &samesum_engine::Model,
) -> Result<samesum_cuda::Cuda> {
    let t = std::time::Instant::now();
    let c = samesum_cuda::Cuda::with_options(n, model, true, opts)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match c.tier_stats() {
        None => eprintln!(
            "{}: {:.2} GiB of weights resident in {:.2}s",
            samesum_engine::Backend::name(&c),
            gib(c.resident_bytes() as u64),
            t.elapsed().as_secs_f64()
        ),
        Some((plan, _, pinned)) => eprintln!(
            "{}: tier mode, {:.2} GiB in VRAM (trunk {:.2} GiB, {} expert slots per layer, two staging buffers of {:.2} GiB), {:.2} GiB of experts in {} host memory, in {:.2}s",
            samesum_engine::Backend::name(&c),
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
            t.elapsed().as_secs_f64()
        ),
    }
    Ok(c)
}

/// Run `$body` with `$b` bound to the backend `$dev` selects.
macro_rules! with_backend {
    ($dev:expr, $model:expr, $threads:expr, |$b:ident| $body:expr) => {
        match $dev {
            $crate::device::Device::Cpu => {
                let $b = &samesum_engine::cpu::Cpu::new($threads);
                $body
            }
            $crate::device::Device::Cuda(n, opts) => {
                let $b = &$crate::device::cuda(n, opts, $model)?;
                $body
            }
        }
    };
}
pub(crate) use with_backend;

#[cfg(test)]
mod tests {
    use super::{Attention, Device};

    fn cuda(n: usize, budget: Option<u64>) -> Device {
        Device::Cuda(
            n,
            samesum_cuda::CudaOptions {
                vram_budget: budget,
                fast_attention: false,
            },
        )
    }

    #[test]
    fn default_chunks_follow_the_device() {
        assert_eq!(
            Device::Cpu.default_chunk(false),
            samesum_engine::DEFAULT_CHUNK
        );
        assert_eq!(cuda(0, None).default_chunk(false), 2048);
        assert_eq!(cuda(0, Some(24 << 30)).default_chunk(true), 512);
        assert_eq!(Device::Cpu.serve_chunk(), 128);
        assert_eq!(cuda(0, None).serve_chunk(), 512);
    }

    #[test]
    fn parses_devices() {
        assert_eq!(Device::parse("cpu", None).unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda", None).unwrap(), cuda(0, None));
        assert_eq!(Device::parse("CUDA:3", None).unwrap(), cuda(3, None));
        assert_eq!(
            Device::parse("cuda", Some("24G")).unwrap(),
            cuda(0, Some(24 << 30))
        );
        assert!(Device::parse("cuda:x", None).is_err());
        assert!(Device::parse("tpu", None).is_err());
        assert!(Device::parse("cuda", Some("lots")).is_err());
        let e = Device::parse("cpu", Some("24G")).unwrap_err().to_string();
        assert!(e.contains("--vram-budget"), "{e}");
    }

    #[test]
    fn fast_attention_is_cuda_only() {
        let d = Device::parse("cuda", None).unwrap();
        assert_eq!(d.with_attention(Attention::Exact).unwrap(), d);
        match d.with_attention(Attention::Fast).unwrap() {
            Device::Cuda(0, o) => assert!(o.fast_attention && o.vram_budget.is_none()),
            other => panic!("{other:?}"),
        }
        let e = Device::Cpu
            .with_attention(Attention::Fast)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--attention fast"), "{e}");
        assert_eq!(
            Device::Cpu.with_attention(Attention::Exact).unwrap(),
            Device::Cpu
        );
    }
}
