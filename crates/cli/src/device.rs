//! `--device cpu|cuda[:N]`: which backend a command runs on.

use anyhow::{Result, bail};

/// A parsed `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Device {
    /// The CPU backend.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl Device {
    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    pub(crate) fn parse(s: &str) -> Result<Device> {
        let s = s.trim().to_ascii_lowercase();
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if s == "cuda" || s == "gpu" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            return match n.parse() {
                Ok(i) => Ok(Device::Cuda(i)),
                Err(_) => bail!("--device {s:?}: expected cuda:N with N a device number"),
            };
        }
        bail!("--device {s:?} is not supported (cpu, cuda, cuda:N)")
    }
}

/// Open the CUDA backend for `model` on device `n`, uploading its weights with a
/// progress bar; errors say what is missing (driver, NVRTC, device, memory).
pub(crate) fn cuda(n: usize, model: &samesum_engine::Model) -> Result<samesum_cuda::Cuda> {
    let t = std::time::Instant::now();
    let c = samesum_cuda::Cuda::new(n, model, true)?;
    eprintln!(
        "{}: {:.2} GiB of weights resident in {:.2}s",
        samesum_engine::Backend::name(&c),
        c.resident_bytes() as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );
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
            $crate::device::Device::Cuda(n) => {
                let $b = &$crate::device::cuda(n, $model)?;
                $body
            }
        }
    };
}
pub(crate) use with_backend;

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn parses_devices() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(Device::parse("CUDA:3").unwrap(), Device::Cuda(3));
        assert!(Device::parse("cuda:x").is_err());
        assert!(Device::parse("tpu").is_err());
    }
}
