//! `samesum bench-gemm`: the MoE block's speed per weight format. For each
//! format, one layer of a model shape is written with every matrix in that
//! format, loaded on the chosen backend, and its MoE block (router, expert
//! plan, gathered expert matmuls, combine, shared expert) run over `m` rows
//! of random activations, as one prefill chunk does. The expert matmuls'
//! operations (2 x rows x K per token and slot, gate, up and down, plus the
//! shared expert) over the block's whole time give a lower bound on the
//! format's GEMM throughput; `--profile` adds the per-kernel times on CUDA,
//! where the GEMM kernels' own share is read off.

use crate::args::{BackendArgs, ThreadsArgs};
use crate::with_backend;
use anyhow::{Context, Result, bail};
use samesum_engine::{Backend, Model};
use samesum_gguf::GgmlType;
use samesum_quant::rng::Rng;
use std::time::Instant;

/// Arguments of `samesum bench-gemm`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Model shape (its hidden size, experts, experts a token and expert
    /// width; one layer of it is written).
    #[arg(long, default_value = "qwen3moe-30b-a3b")]
    shape: String,
    /// Formats (comma-separated; default: every format `synth --quant`
    /// writes).
    #[arg(long, value_delimiter = ',')]
    formats: Vec<String>,
    /// Rows a call (the tokens of one prefill chunk; comma-separated for
    /// several, each a row of the table).
    #[arg(short = 'm', long, value_delimiter = ',', default_value = "4096")]
    rows: Vec<usize>,
    /// Timed calls a format, after one untimed.
    #[arg(short = 'r', long, default_value_t = 10)]
    repetitions: usize,
    /// Per-kernel times on CUDA (CUDA events around every launch), printed
    /// after each format's row.
    #[arg(long)]
    profile: bool,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    threads: ThreadsArgs,
}

/// The expert matmuls' operations for `m` rows: gate, up and down of each
/// of the `k` chosen experts (`ff` wide) and of the shared expert (`shared`
/// wide, 0 without one), two operations a multiply-add.
pub(crate) fn moe_ops(m: usize, hidden: usize, k: usize, ff: usize, shared: usize) -> f64 {
    let per_row = 3.0 * 2.0 * hidden as f64 * (k * ff + shared) as f64;
    m as f64 * per_row
}

/// The formats to measure: `names` parsed, or every one synth writes.
fn formats(names: &[String]) -> Result<Vec<GgmlType>> {
    if names.is_empty() {
        return Ok(samesum_synth::QUANT_CHOICES.to_vec());
    }
    names
        .iter()
        .map(|s| {
            GgmlType::from_name(s)
                .filter(|t| samesum_synth::QUANT_CHOICES.contains(t))
                .with_context(|| {
                    let known: Vec<String> = samesum_synth::QUANT_CHOICES
                        .iter()
                        .map(|t| t.name().to_lowercase())
                        .collect();
                    format!("unknown format {s:?} (known: {})", known.join(", "))
                })
        })
        .collect()
}

pub(crate) fn run(a: Args) -> Result<()> {
    if let Some(&m) = a.rows.iter().find(|&&m| m == 0 || m > 1 << 16) {
        bail!("-m must be 1 to 65,536 rows (it was {m})");
    }
    if a.rows.is_empty() {
        bail!("-m needs at least one row count");
    }
    if a.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    let formats = formats(&a.formats)?;
    let dev = a.backend.device(a.threads.threads)?;
    if a.profile {
        // SAFETY: set before any thread of this process reads the environment.
        unsafe { std::env::set_var("SAMESUM_CUDA_PROFILE", "1") };
    }
    println!("| shape | format | rows | backend | MoE block (ms) | expert matmuls (TOPS) |");
    println!("| --- | --- | ---: | --- | ---: | ---: |");
    for ty in formats {
        let name = ty.name().to_lowercase();
        let opts = crate::synth::options(&a.shape, &name, Some(1), 7)?;
        let dir = tempfile::tempdir().context("a temporary folder for the model")?;
        let path = dir.path().join(format!("{}-{name}.gguf", a.shape));
        samesum_synth::write_model(&opts, &path, &mut |_, _| {})
            .with_context(|| format!("writing the {name} layer"))?;
        let model = Model::load(&path).with_context(|| format!("loading {}", path.display()))?;
        let backend = match crate::args::open(dev, &model) {
            Ok(b) => b,
            Err(e) => {
                // A format this backend has no kernel for: say so, go on.
                let rows: Vec<String> = a.rows.iter().map(|m| m.to_string()).collect();
                println!(
                    "| {} | {name} | {} | - | {e:#} | |",
                    a.shape,
                    rows.join(",")
                );
                continue;
            }
        };
        for &m in &a.rows {
            let (secs, label, report) =
                with_backend!(&backend, |b| time_moe(b, &model, m, a.repetitions))?;
            let hp = &model.hp;
            let ops = moe_ops(m, hp.n_embd, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp);
            println!(
                "| {} | {name} | {m} | {label} | {:.3} | {:.2} |",
                a.shape,
                secs * 1e3,
                ops / secs / 1e12
            );
            if let Some(r) = report {
                println!("\n{r}");
            }
        }
    }
    Ok(())
}

/// The MoE block of layer 0 over `m` random rows: one untimed call, then
/// `reps` calls back to back and one read of the result (which waits for
/// them); the mean seconds a call, the backend's name and its kernel report.
fn time_moe<B: Backend>(
    b: &B,
    model: &Model,
    m: usize,
    reps: usize,
) -> Result<(f64, String, Option<String>)> {
    let d = model.hp.n_embd;
    let mut rng = Rng::new(11);
    let host: Vec<f32> = (0..m * d).map(|_| rng.range(-1.0, 1.0)).collect();
    let x = b.upload(&host)?;
    let mut y = b.alloc(m * d)?;
    let mw = &model.w.layers[0].moe;
    b.moe(model, mw, &x, &mut y)?;
    b.download(&y)?;
    b.take_report()?;
    let t = Instant::now();
    for _ in 0..reps {
        b.moe(model, mw, &x, &mut y)?;
    }
    let out = b.download(&y)?;
    let secs = t.elapsed().as_secs_f64() / reps as f64;
    if out.iter().any(|v| !v.is_finite()) {
        bail!("the MoE block gave non-finite values");
    }
    Ok((secs, b.name(), b.take_report()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_count_gate_up_and_down_of_every_chosen_and_shared_expert() {
        // One row, hidden 2, 2 experts of width 3 chosen, shared width 5:
        // 3 matrices x 2 ops x 2 x (2 x 3 + 5).
        assert_eq!(moe_ops(1, 2, 2, 3, 5), 132.0);
        assert_eq!(moe_ops(10, 2, 2, 3, 0), 10.0 * 72.0);
    }

    #[test]
    fn formats_parse_and_unknown_ones_are_named() {
        assert_eq!(
            formats(&["q8_0".into(), "IQ4_XS".into()]).unwrap(),
            vec![GgmlType::Q8_0, GgmlType::IQ4_XS]
        );
        assert_eq!(
            formats(&[]).unwrap().len(),
            samesum_synth::QUANT_CHOICES.len()
        );
        let e = formats(&["q9_9".into()]).unwrap_err().to_string();
        assert!(e.contains("q9_9") && e.contains("q4_k"), "{e}");
    }
}
