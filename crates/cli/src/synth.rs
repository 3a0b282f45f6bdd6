//! `samesum synth`: write a synthetic model, with a progress bar.

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use samesum_gguf::GgmlType;
use samesum_synth::{SynthOptions, shapes, write_model};
use std::path::{Path, PathBuf};

/// Arguments of `samesum synth`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Shape: qwen3moe-30b-a3b, qwen3next-80b-a3b, qwen35moe-35b-a3b,
    /// qwen35moe-122b-a10b, tiny-qwen3moe, tiny-qwen3next, tiny-qwen35moe.
    #[arg(long, default_value = "tiny-qwen3moe")]
    shape: String,
    /// Number of trunk layers (default: the shape's).
    #[arg(long)]
    layers: Option<u32>,
    /// Storage type of weight matrices: q4_k, q5_k, q6_k, q8_0, q4_0, bf16, f16, f32.
    #[arg(long, default_value = "q8_0")]
    quant: String,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
    /// Overwrite the output if it exists.
    #[arg(long)]
    force: bool,
}

/// Parse a shape/quant/layers triple into options.
pub(crate) fn options(
    shape: &str,
    quant: &str,
    layers: Option<u32>,
    seed: u64,
) -> Result<SynthOptions> {
    let Some(s) = shapes::by_name(shape) else {
        bail!(
            "unknown shape {shape:?} (known: {})",
            shapes::names().join(", ")
        );
    };
    let q = GgmlType::from_name(quant).filter(|q| samesum_synth::QUANT_CHOICES.contains(q));
    let Some(q) = q else {
        let choices: Vec<String> = samesum_synth::QUANT_CHOICES
            .iter()
            .map(|t| t.name().to_lowercase())
            .collect();
        bail!(
            "--quant {quant:?} is not supported (choose one of: {})",
            choices.join(", ")
        );
    };
    let mut o = SynthOptions::new(s, q, seed);
    if let Some(l) = layers {
        o = o.with_layers(l);
    }
    Ok(o)
}

/// Write `opts` to `path` with a progress bar on a terminal.
pub(crate) fn write(opts: &SynthOptions, path: &Path) -> Result<samesum_synth::Summary> {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("synth {}", opts.shape.name));
    let summary = write_model(opts, path, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("writing {}", path.display()))?;
    bar.finish_and_clear();
    Ok(summary)
}

/// The model a command runs on: `model` if given, else a synthetic `shape`
/// model (`quant`) written to a temporary folder that lives as long as the
/// returned guard; `note` is printed when the built-in model is used.
pub(crate) fn model_or_builtin(
    model: &Option<PathBuf>,
    shape: &str,
    quant: &str,
    note: Option<&str>,
) -> Result<(PathBuf, Option<tempfile::TempDir>)> {
    if let Some(p) = model {
        return Ok((p.clone(), None));
    }
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let p = dir.path().join(format!("{shape}.gguf"));
    if let Some(n) = note {
        eprintln!("{n}");
    }
    write(&options(shape, quant, None, 0)?, &p)?;
    Ok((p, Some(dir)))
}

pub(crate) fn run(a: Args) -> Result<()> {
    let opts = options(&a.shape, &a.quant, a.layers, a.seed)?;
    if a.output.exists() && !a.force {
        bail!("{} exists (use --force to overwrite)", a.output.display());
    }
    let t = std::time::Instant::now();
    let s = write(&opts, &a.output)?;
    eprintln!(
        "wrote {}: {} {} layers, {} tensors, {:.1} MiB of tensor data, vocab {}, in {:.1}s",
        a.output.display(),
        opts.shape.name,
        opts.shape.layers,
        s.tensors,
        s.bytes as f64 / (1 << 20) as f64,
        s.vocab,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
