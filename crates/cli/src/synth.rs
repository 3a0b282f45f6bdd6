//! `samesum synth`: write a synthetic model, with a progress bar.

use anyhow::{Context, Result, bail};
use clap::builder::{PossibleValue, PossibleValuesParser};
use indicatif::{ProgressBar, ProgressStyle};
use samesum_gguf::GgmlType;
use samesum_synth::mix::{self, Mix};
use samesum_synth::{SynthOptions, shapes, write_model};
use std::path::{Path, PathBuf};

/// `--mix`'s values, each with the line on where its layout comes from
/// (`mxfp4` also answers to llama.cpp's name for it, `mxfp4_moe`).
fn mix_values() -> PossibleValuesParser {
    PossibleValuesParser::new(mix::ALL.iter().map(|m| {
        let v = PossibleValue::new(m.name()).help(m.about());
        if m.name() == "mxfp4" {
            v.alias("mxfp4_moe")
        } else {
            v
        }
    }))
}

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
    /// One storage type for every weight matrix: q4_k, q5_k, q6_k, q8_0,
    /// q4_0, bf16, f16, f32 (q4_k keeps a q6_K output head, as llama.cpp's
    /// Q4_K files do). [default: q8_0]
    #[arg(long, conflicts_with = "mix")]
    quant: Option<String>,
    /// Per-tensor types as real quantized files of this kind have them,
    /// instead of --quant.
    ///
    /// The llama.cpp presets apply llama-quantize's type selection to the
    /// shape (by tensor role, layer, attention head ratio, expert count and
    /// row length), and write llama.cpp's file type number as
    /// general.file_type. The i-quant presets (iq*) assume an importance
    /// matrix, as published i-quant files are made with one; the others
    /// assume none. Norms, the expert router and the delta net's conv stay
    /// f32. The tiny shapes have 8 experts, for which llama-quantize raises
    /// attn_v and attn_k to Q8_0 and attn_output to Q5_K. ud-q4_k_xl approximates the dynamic UD-Q4_K_XL uploads' published
    /// layout; it is not a llama-quantize file type.
    #[arg(long, value_name = "PRESET", value_parser = mix_values(), ignore_case = true)]
    mix: Option<String>,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Declare YaRN rope scaling by this factor (1 < factor <= 64): the
    /// shape's context becomes rope.scaling.original_context_length and the
    /// file's context_length grows by the factor, as llama.cpp's converter
    /// writes a Hugging Face rope_scaling of type yarn.
    #[arg(long, value_name = "FACTOR")]
    yarn: Option<f32>,
    /// Write this Jinja file as the model's chat template (e.g. a real
    /// Qwen template, for tools and reasoning) instead of plain ChatML.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Write the model as split files of at most N tensors each, as
    /// llama.cpp's gguf-split does: -o out.gguf makes out-00001-of-0000K.gguf,
    /// ... (the first with all the metadata, every one with split.* keys).
    /// Any command opens a split model from any of its shards.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    split_max_tensors: Option<u64>,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
    /// Overwrite the output if it exists.
    #[arg(long)]
    force: bool,
}

/// Parse a shape/quant/layers triple into options (one type throughout).
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

/// Options from the command line: `--mix` if given, else `--quant`.
fn options_of(a: &Args) -> Result<SynthOptions> {
    let quant = a.quant.as_deref().unwrap_or("q8_0");
    let mut opts = options(&a.shape, quant, a.layers, a.seed)?;
    if let Some(n) = a.split_max_tensors {
        opts = opts.with_split_max_tensors(usize::try_from(n).unwrap_or(usize::MAX));
    }
    if let Some(f) = a.yarn {
        if !(f > 1.0 && f <= 64.0) {
            bail!("--yarn {f}: the factor must be above 1 and at most 64");
        }
        opts = opts.with_yarn(f);
    }
    if let Some(p) = &a.chat_template {
        let t = std::fs::read_to_string(p)
            .with_context(|| format!("--chat-template {}", p.display()))?;
        opts = opts.with_chat_template(t);
    }
    Ok(match &a.mix {
        None => opts,
        Some(name) => {
            let Some(m) = Mix::from_name(name) else {
                bail!(
                    "unknown --mix {name:?} (known: {})",
                    mix::names().join(", ")
                );
            };
            opts.with_mix(m)
        }
    })
}

pub(crate) fn run(a: Args) -> Result<()> {
    let opts = options_of(&a)?;
    if !a.force {
        // A split write names its shards only once it knows their number:
        // refuse when any file of this prefix's shard pattern is there.
        let taken = match opts.split_max_tensors {
            None => a.output.exists().then(|| a.output.clone()),
            Some(_) => existing_shard(&a.output),
        };
        if let Some(p) = taken {
            bail!("{} exists (use --force to overwrite)", p.display());
        }
    }
    let t = std::time::Instant::now();
    let s = write(&opts, &a.output)?;
    let mut storage = match opts.mix {
        Some(m) => format!("mix {m}"),
        None => opts.quant.name().to_string(),
    };
    if let Some(f) = opts.yarn {
        storage += &format!(", YaRN x{f}");
    }
    let written = match s.files.as_slice() {
        [one] => one.display().to_string(),
        [first, .., last] => format!(
            "{} files, {} .. {}",
            s.files.len(),
            first.display(),
            last.display()
        ),
        [] => a.output.display().to_string(),
    };
    eprintln!(
        "wrote {written}: {} {} layers, {storage}, {} tensors, {:.1} MiB of tensor data, vocab {}, in {:.1}s",
        opts.shape.name,
        opts.shape.layers,
        s.tensors,
        s.bytes as f64 / (1 << 20) as f64,
        s.vocab,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A file already named as a shard of `output`'s prefix, if any.
fn existing_shard(output: &Path) -> Option<PathBuf> {
    let prefix = samesum_gguf::split::split_prefix(output);
    let dir = match prefix.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (Some(stem), Ok(entries)) = (prefix.file_name(), std::fs::read_dir(&dir)) else {
        return None;
    };
    for e in entries.flatten() {
        let name = PathBuf::from(e.file_name());
        if samesum_gguf::split::parse_split_path(&name)
            .is_some_and(|(pre, _, _)| pre.as_os_str() == stem)
        {
            return Some(dir.join(name));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        synth: Args,
    }

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(["synth"].iter().chain(args)).map(|c| c.synth)
    }

    #[test]
    fn mix_and_quant_are_exclusive() {
        let e = parse(&["--mix", "q4_k_m", "--quant", "q8_0", "-o", "x.gguf"])
            .err()
            .expect("--mix with --quant must be refused");
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        let msg = e.to_string();
        assert!(
            msg.contains("--quant") && msg.contains("--mix"),
            "unclear error: {msg}"
        );
    }

    #[test]
    fn mix_selects_the_preset_and_quant_keeps_its_default() {
        let a = parse(&["--mix", "Q4_K_M", "-o", "x.gguf"]).unwrap();
        let o = options_of(&a).unwrap();
        assert_eq!(o.mix, Mix::from_name("q4_k_m"));
        let a = parse(&["--mix", "mxfp4_moe", "-o", "x.gguf"]).unwrap();
        assert_eq!(options_of(&a).unwrap().mix, Mix::from_name("mxfp4"));
        let a = parse(&["--quant", "q4_k", "-o", "x.gguf"]).unwrap();
        let o = options_of(&a).unwrap();
        assert_eq!((o.quant, o.mix), (GgmlType::Q4_K, None));
        let a = parse(&["-o", "x.gguf"]).unwrap();
        assert_eq!(options_of(&a).unwrap().quant, GgmlType::Q8_0);
        let e = parse(&["--mix", "q4_k", "-o", "x.gguf"]).err().unwrap();
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
    }
}
