//! The argument groups several commands share (`#[command(flatten)]`): each
//! shared flag is defined, documented and checked here once (`identity`'s
//! lists of chunks and threads, `serve`'s chunk and `inspect`'s VRAM budget
//! mean something else there and are their own). Values are parsed when
//! the command line is (a bad `--device`, `--vram-budget`, `--kv-type` or
//! `--chunk` is clap's usage error); what depends on two flags is checked by
//! the group's accessor.

use crate::backend::{AnyBackend, CudaOptions, Device};
use anyhow::{Result, bail};
use samesum_engine::{KvType, Model};
use std::path::PathBuf;

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct ModelArgs {
    /// GGUF model (default: a synthetic model made on the fly, random
    /// weights).
    #[arg(short, long)]
    pub(crate) model: Option<PathBuf>,
}

impl ModelArgs {
    /// The model's path: `-m`, or a synthetic model of `shape` and `quant`
    /// written to a temporary directory (kept while the guard lives), with
    /// `note` printed first when given.
    pub(crate) fn path_or_synth(
        &self,
        shape: &str,
        quant: &str,
        note: Option<&str>,
    ) -> Result<(PathBuf, Option<tempfile::TempDir>)> {
        crate::synth::model_or_builtin(&self.model, shape, quant, note)
    }
}

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct ShapeArgs {
    /// Synthetic shape when no -m is given.
    #[arg(long, default_value = "tiny-qwen3next")]
    pub(crate) shape: String,
}

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct BackendArgs {
    /// Backend: cpu, cuda or cuda:N. [default: cpu; with -ngl above 0, cuda
    /// when a CUDA device is present]
    #[arg(long)]
    device: Option<Device>,
    /// GPU layers, as llama.cpp's -ngl (which samesum also takes). samesum
    /// puts the whole model on one device, never part of its layers: N above
    /// 0 (or `all`, `auto`, -1) means the GPU (cuda when no --device is given
    /// and a CUDA device is present, else a note and the CPU), 0 the CPU. A
    /// model larger than the GPU's memory runs in tier mode (--vram-budget).
    #[arg(long = "n-gpu-layers", value_name = "N", value_parser = parse_gpu_layers,
          allow_negative_numbers = true)]
    n_gpu_layers: Option<GpuLayers>,
    /// Flash attention, as llama.cpp's -fa (which samesum also takes):
    /// accepted, changes nothing; `on` and `off` print a note saying so.
    /// samesum's attention is chosen by --attention: on CUDA the f16
    /// tensor-core flash kernel by default, `--attention exact` for the f32
    /// reference; on the CPU exact f32.
    #[arg(long = "flash-attn", value_enum, value_name = "on|off|auto")]
    flash_attn: Option<FlashAttn>,
    /// Tier mode within this VRAM budget (e.g. 24G): routed experts in host
    /// memory, a VRAM cache of them for decode, staged layers for prefill.
    /// Without it, tier mode starts by itself when the model does not fit.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    vram_budget: Option<u64>,
    /// Attention passes: `fast` (CUDA's default: flash attention on f16
    /// tensor cores, as llama.cpp computes it) or `exact` (f32; the CPU's
    /// only one, and on CUDA with `--kv-type f32` the reference
    /// configuration). Batched prefill equals replay with either
    /// (docs/CAPABILITIES.md: fast's bars against the reference).
    #[arg(long, value_enum)]
    attention: Option<Attention>,
}

/// `--n-gpu-layers`: a count of layers, or all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuLayers {
    /// `all`, `auto` or a negative count (llama.cpp's spellings of "as many
    /// as fit").
    All,
    /// A count of layers (0: none).
    Count(u64),
}

impl GpuLayers {
    /// Whether it asks for the GPU.
    fn wants_gpu(self) -> bool {
        self != GpuLayers::Count(0)
    }
}

impl std::fmt::Display for GpuLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuLayers::All => f.write_str("all"),
            GpuLayers::Count(n) => write!(f, "{n}"),
        }
    }
}

fn parse_gpu_layers(s: &str) -> Result<GpuLayers, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("all") || s.eq_ignore_ascii_case("auto") {
        return Ok(GpuLayers::All);
    }
    match s.parse::<i64>() {
        Ok(n) if n < 0 => Ok(GpuLayers::All),
        Ok(n) => Ok(GpuLayers::Count(n as u64)),
        Err(_) => Err(format!(
            "expected a layer count, `all` or `auto`, not {s:?}"
        )),
    }
}

/// `--flash-attn`: llama.cpp's spellings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum FlashAttn {
    /// Flash attention on (a note: samesum's attention is already so on CUDA).
    #[value(alias = "1")]
    On,
    /// Flash attention off (a note: there is no other attention to fall back to).
    #[value(alias = "0")]
    Off,
    /// The device's choice (no note).
    Auto,
}

/// `--attention`: which attention passes a backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Attention {
    /// f32 attention in samesum's exact order (CUDA cores on the GPU): the
    /// default, the reference configuration with `--kv-type f32`, and the
    /// CPU's only one.
    Exact,
    /// Flash attention on f16 tensor cores with f32 accumulation (q, k, v
    /// and the probabilities rounded to f16, as llama.cpp's default), CUDA
    /// only, opt-in. One function for decode and prefill (batched equals
    /// replay); docs/CAPABILITIES.md has its bars against `exact`.
    Fast,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    samesum_cuda::tier::parse_bytes(s)
}

impl BackendArgs {
    /// Whether `--attention` was given (else the device's default).
    pub(crate) fn attention_given(&self) -> bool {
        self.attention.is_some()
    }

    /// The device with `--vram-budget` and `--attention` applied and `threads`
    /// CPU threads; both options apply to CUDA only. `--n-gpu-layers` picks
    /// the device when `--device` is not given (and must agree with it when
    /// it is); `--flash-attn` prints a note (see its help).
    pub(crate) fn device(&self, threads: usize) -> Result<Device> {
        self.device_with(threads, samesum_cuda::device_count)
    }

    /// [`Self::device`] with `cuda_devices` counting the CUDA devices.
    fn device_with(&self, threads: usize, cuda_devices: impl Fn() -> usize) -> Result<Device> {
        match self.flash_attn {
            Some(FlashAttn::On) => eprintln!(
                "note: -fa on changes nothing: --attention picks samesum's attention \
                 (--attention fast: flash attention on CUDA's tensor cores)"
            ),
            Some(FlashAttn::Off) => eprintln!(
                "note: -fa off changes nothing: --attention picks samesum's attention \
                 (--attention exact for the f32 reference; CUDA's default is fast)"
            ),
            Some(FlashAttn::Auto) | None => {}
        }
        let cuda0 = Device::Cuda(0, CudaOptions::default());
        let device = match (self.device, self.n_gpu_layers) {
            (Some(d), None) => d,
            (None, None) => Device::Cpu(0),
            (Some(Device::Cpu(_)), Some(n)) if n.wants_gpu() => {
                bail!("--n-gpu-layers {n} asks for the GPU, but --device cpu was given")
            }
            (Some(Device::Cuda(..)), Some(GpuLayers::Count(0))) => {
                bail!("--n-gpu-layers 0 means the CPU, but --device cuda was given")
            }
            (Some(d), Some(_)) => d,
            (None, Some(n)) if n.wants_gpu() => {
                if cuda_devices() > 0 {
                    cuda0
                } else {
                    eprintln!("note: --n-gpu-layers {n}: no CUDA device found; running on the CPU");
                    Device::Cpu(0)
                }
            }
            (None, Some(_)) => Device::Cpu(0),
        };
        match device {
            Device::Cpu(_) => {
                if self.vram_budget.is_some() {
                    bail!("--vram-budget applies to --device cuda, not the CPU");
                }
                if self.attention == Some(Attention::Fast) {
                    bail!("--attention fast applies to --device cuda, not the CPU");
                }
                Ok(Device::Cpu(threads))
            }
            Device::Cuda(n, _) => Ok(Device::Cuda(
                n,
                CudaOptions {
                    vram_budget: self.vram_budget,
                    fast_attention: self.attention != Some(Attention::Exact),
                },
            )),
        }
    }

    /// `--attention` as given (None: the device's default).
    #[cfg(test)]
    fn attention(&self) -> Option<Attention> {
        self.attention
    }
}

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct ThreadsArgs {
    /// CPU worker threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub(crate) threads: usize,
}

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct KvArgs {
    /// KV cache type: f16 (the default, as llama.cpp's: half the memory per
    /// token) or f32 (with exact attention the reference configuration);
    /// see docs/CAPABILITIES.md.
    #[arg(long = "kv-type", value_enum)]
    kv_type: Option<Kv>,
}

/// `--kv-type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Kv {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// bfloat16 (CPU only).
    Bf16,
}

impl KvArgs {
    /// The KV cache type on `dev`: `--kv-type`, else f16, the default on
    /// every device (each met the bars written for it, docs/CAPABILITIES.md).
    /// bf16 is the CPU's only.
    pub(crate) fn kv(&self, dev: &Device) -> Result<KvType> {
        let kv = self.given().unwrap_or(KvType::F16);
        if kv == KvType::BF16 && matches!(dev, Device::Cuda(..)) {
            bail!("--kv-type bf16 runs on the CPU only; on CUDA use f16 (the default) or f32");
        }
        Ok(kv)
    }

    /// `--kv-type` as given (None: the device's default).
    pub(crate) fn given(&self) -> Option<KvType> {
        self.kv_type.map(|k| match k {
            Kv::F32 => KvType::F32,
            Kv::F16 => KvType::F16,
            Kv::Bf16 => KvType::BF16,
        })
    }
}

/// A KV cache type's name on the command line.
pub(crate) fn kv_name(kv: KvType) -> &'static str {
    match kv {
        KvType::F32 => "f32",
        KvType::F16 => "f16",
        KvType::BF16 => "bf16",
    }
}

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct ChunkArgs {
    /// Prompt rows per batched forward call (also -ub/--ubatch-size,
    /// llama.cpp's spellings; any size computes the same bytes).
    /// [default: 256 on the CPU, 2048 on CUDA, 512 on CUDA in tier mode]
    #[arg(long, visible_alias = "ubatch-size", value_parser = at_least_one)]
    chunk: Option<usize>,
}

impl ChunkArgs {
    /// `--chunk`, or the backend's default.
    pub(crate) fn or_default(&self, backend: &AnyBackend) -> usize {
        self.chunk.unwrap_or_else(|| backend.default_chunk())
    }
}

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct CtxArgs {
    /// Context size in tokens (per request when serving: prompt and
    /// completion; 0: the model's trained context, as llama.cpp's -c 0;
    /// above it, a warning).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx: usize,
}

impl CtxArgs {
    /// The context for `model`: `-c`, or with `-c 0` the context the model
    /// was trained on (`{arch}.context_length`, 4096 when the file lacks
    /// it), printed. A `-c` above the trained context (when the file has
    /// it) is a warning (stderr): it still runs, but positions past the
    /// trained length are outside what the model learned.
    pub(crate) fn for_model(&self, model: &Model) -> usize {
        let key = format!("{}.context_length", model.hp.arch.name());
        let trained = model.hp.n_ctx_train;
        if self.ctx == 0 {
            eprintln!("context: {trained} tokens (-c 0: the model's trained context)");
            return trained;
        }
        if model.file.metadata().get(&key).is_some() && self.ctx > trained {
            eprintln!(
                "warning: -c {} is above the model's trained context of {trained} tokens \
                 ({key}); positions past it may generate poorly",
                self.ctx
            );
        }
        self.ctx
    }
}

/// A count of at least 1 (`--chunk`).
pub(crate) fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--prefill`: how a prompt goes through the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Prefill {
    /// Chunks of --chunk rows per forward call.
    Batched,
    /// One token per call.
    Replay,
}

impl std::fmt::Display for Prefill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Prefill::Batched => "batched",
            Prefill::Replay => "replay",
        })
    }
}

/// Open `device` for `model` (CUDA: uploading its weights with a progress
/// bar, then one line on where they went).
pub(crate) fn open(device: Device, model: &Model) -> Result<AnyBackend> {
    let t = std::time::Instant::now();
    let b = AnyBackend::open(device, model, true)?;
    if let Some(line) = b.placement(t.elapsed().as_secs_f64()) {
        eprintln!("{line}");
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        backend: BackendArgs,
        #[command(flatten)]
        kv: KvArgs,
        #[command(flatten)]
        chunk: ChunkArgs,
    }

    fn parse(args: &[&str]) -> Result<Cmd, clap::Error> {
        Cmd::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
    }

    fn cuda(n: usize, budget: Option<u64>, fast: bool) -> Device {
        Device::Cuda(
            n,
            CudaOptions {
                vram_budget: budget,
                fast_attention: fast,
            },
        )
    }

    #[test]
    fn devices_take_their_options() {
        let d = |args: &[&str]| parse(args).unwrap().backend.device(3).unwrap();
        assert_eq!(d(&[]), Device::Cpu(3));
        assert_eq!(d(&["--attention", "exact"]), Device::Cpu(3));
        assert_eq!(d(&["--device", "CUDA:2"]), cuda(2, None, true));
        assert_eq!(
            d(&["--device", "cuda", "--vram-budget", "24G"]),
            cuda(0, Some(24 << 30), true)
        );
        assert_eq!(
            d(&["--device", "gpu", "--attention", "fast"]),
            cuda(0, None, true)
        );
        assert_eq!(
            d(&["--device", "gpu", "--attention", "exact"]),
            cuda(0, None, false)
        );
    }

    #[test]
    fn bad_values_are_usage_errors_naming_the_flag() {
        for (args, flag) in [
            (&["--device", "tpu"][..], "--device"),
            (&["--device", "cuda:x"], "--device"),
            (&["--vram-budget", "lots"], "--vram-budget"),
            (&["--kv-type", "q8"], "--kv-type"),
            (&["--chunk", "0"], "--chunk"),
            (&["--attention", "quick"], "--attention"),
        ] {
            let e = parse(args).err().expect("an error").to_string();
            assert!(e.contains(flag), "{args:?}: {e}");
        }
    }

    #[test]
    fn cuda_options_on_the_cpu_are_errors() {
        for (args, flag) in [
            (&["--vram-budget", "24G"][..], "--vram-budget"),
            (&["--attention", "fast"], "--attention fast"),
        ] {
            let e = parse(args).unwrap().backend.device(0).unwrap_err();
            assert!(e.to_string().contains(flag), "{e}");
        }
    }

    #[test]
    fn gpu_layers_pick_the_device_when_none_is_given() {
        let d = |args: &[&str], gpus: usize| parse(args).unwrap().backend.device_with(3, || gpus);
        for n in ["1", "99", "all", "auto", "-1"] {
            assert_eq!(d(&["--n-gpu-layers", n], 1).unwrap(), cuda(0, None, true));
            assert_eq!(d(&["--n-gpu-layers", n], 0).unwrap(), Device::Cpu(3));
        }
        assert_eq!(d(&["--n-gpu-layers", "0"], 1).unwrap(), Device::Cpu(3));
        // The CUDA options go with the device -ngl picked.
        assert_eq!(
            d(&["--n-gpu-layers", "99", "--vram-budget", "24G"], 1).unwrap(),
            cuda(0, Some(24 << 30), true)
        );
        // A given --device stands, and must agree with -ngl.
        assert_eq!(
            d(&["--n-gpu-layers", "5", "--device", "cuda:1"], 2).unwrap(),
            cuda(1, None, true)
        );
        assert!(d(&["--n-gpu-layers", "5", "--device", "cpu"], 1).is_err());
        assert!(d(&["--n-gpu-layers", "0", "--device", "cuda"], 1).is_err());
    }

    #[test]
    fn flash_attn_never_changes_the_attention() {
        for v in ["on", "off", "auto", "1", "0"] {
            let b = parse(&["--flash-attn", v, "--device", "cuda"])
                .unwrap()
                .backend;
            assert_eq!(b.attention(), None);
            assert_eq!(b.device(0).unwrap(), cuda(0, None, true));
            let b = parse(&[
                "--flash-attn",
                v,
                "--attention",
                "exact",
                "--device",
                "cuda",
            ])
            .unwrap()
            .backend;
            assert_eq!(b.device(0).unwrap(), cuda(0, None, false));
            let b = parse(&["--flash-attn", v, "--attention", "fast", "--device", "cuda"])
                .unwrap()
                .backend;
            assert_eq!(b.device(0).unwrap(), cuda(0, None, true));
        }
    }

    #[test]
    fn kv_types_parse_with_the_default() {
        let cpu = Device::Cpu(1);
        let none = parse(&[]).unwrap().kv;
        assert_eq!((none.kv(&cpu).unwrap(), none.given()), (KvType::F16, None));
        let f16 = parse(&["--kv-type", "f16"]).unwrap().kv;
        assert_eq!(
            (f16.kv(&cpu).unwrap(), f16.given()),
            (KvType::F16, Some(KvType::F16))
        );
        let f32 = parse(&["--kv-type", "f32"]).unwrap().kv;
        assert_eq!(
            (f32.kv(&cpu).unwrap(), kv_name(f32.kv(&cpu).unwrap())),
            (KvType::F32, "f32")
        );
        // bf16: the CPU's only, a plain error on CUDA.
        let bf16 = parse(&["--kv-type", "bf16"]).unwrap().kv;
        assert_eq!(bf16.kv(&cpu).unwrap(), KvType::BF16);
        let err = bf16.kv(&cuda(0, None, true)).unwrap_err().to_string();
        assert!(err.contains("CPU only"), "{err}");
    }
}
