//! `samesum bench-quant`: dequantize and dot throughput per format and kernel
//! family, on random blocks in cache-resident and memory-resident sizes.

use anyhow::{Result, bail};
use samesum_gguf::GgmlType;
use samesum_quant::dequant::{can_dequantize, dequantize};
use samesum_quant::dot::{self, ActRow, DOT_FORMATS};
use samesum_quant::isa::Isa;
use samesum_quant::rng::Rng;
use samesum_quant::testing::random_weight_blocks;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Arguments of `samesum bench-quant`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Formats to measure (comma-separated; default: all with a dot kernel).
    #[arg(long, value_delimiter = ',')]
    formats: Vec<String>,
    /// Weight bytes per measurement (default 64 MiB: larger than the caches).
    #[arg(long, default_value_t = 64 << 20)]
    bytes: usize,
    /// Minimum time per measurement, in milliseconds.
    #[arg(long, default_value_t = 300)]
    min_ms: u64,
    /// Row length in elements.
    #[arg(long, default_value_t = 4096)]
    row: usize,
    /// Activation rows per call (> 1 measures `dot_rows_multi`, the prefill path).
    #[arg(long, default_value_t = 1)]
    acts: usize,
}

fn time(min: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    let start = Instant::now();
    while start.elapsed() < min {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

pub(crate) fn run(a: Args) -> Result<()> {
    let formats: Vec<GgmlType> = if a.formats.is_empty() {
        DOT_FORMATS.to_vec()
    } else {
        a.formats
            .iter()
            .map(|s| GgmlType::from_name(s).ok_or_else(|| anyhow::anyhow!("unknown format {s:?}")))
            .collect::<Result<_>>()?
    };
    if !a.row.is_multiple_of(256) || a.row == 0 {
        bail!("--row must be a positive multiple of 256");
    }
    let min = Duration::from_millis(a.min_ms);
    if a.acts > 1 {
        return run_multi(&a, &formats, min);
    }
    let isas = Isa::available();
    println!(
        "single thread; {} MiB of weights per pass; row {} elements; best of repeated passes",
        a.bytes >> 20,
        a.row
    );
    println!(
        "kernel families on this CPU: {}",
        isas.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ")
    );
    println!();
    print!("| format | bits/weight | dequant GB/s (in) | dequant Gelem/s |");
    for i in &isas {
        print!(" dot {i} GB/s | dot {i} Gelem/s |");
    }
    println!();
    print!("|---|---|---|---|");
    for _ in &isas {
        print!("---|---|");
    }
    println!();
    let mut rng = Rng::new(1);
    for ty in formats {
        if dot::act_type(ty).is_none() {
            bail!("{ty} has no dot kernel");
        }
        let row_bytes = samesum_quant::row_size(ty, a.row)?;
        let rows = (a.bytes / row_bytes).max(1);
        let w = random_weight_blocks(ty, rows * a.row / ty.block_size(), &mut rng)
            .ok_or_else(|| anyhow::anyhow!("no random generator for {ty}"))?;
        let bits = ty.type_size() as f64 * 8.0 / ty.block_size() as f64;
        let elems = (rows * a.row) as f64;
        let (gbs, gel) = if can_dequantize(ty) {
            let mut out = vec![0f32; a.row];
            let t = time(min, || {
                for r in 0..rows {
                    dequantize(ty, &w[r * row_bytes..(r + 1) * row_bytes], &mut out).unwrap();
                    black_box(&out);
                }
            });
            (
                format!("{:.2}", w.len() as f64 / t / 1e9),
                format!("{:.2}", elems / t / 1e9),
            )
        } else {
            ("-".into(), "-".into())
        };
        print!("| {ty} | {bits:.2} | {gbs} | {gel} |");
        let x: Vec<f32> = (0..a.row).map(|_| rng.range(-1.0, 1.0)).collect();
        let act = ActRow::quantize(ty, &x)?;
        for &isa in &isas {
            let t = time(min, || {
                let mut s = 0f32;
                for r in 0..rows {
                    s += dot::dot_with(isa, ty, &w[r * row_bytes..(r + 1) * row_bytes], &act)
                        .unwrap();
                }
                black_box(s);
            });
            print!(
                " {:.2} | {:.2} |",
                w.len() as f64 / t / 1e9,
                elems / t / 1e9
            );
        }
        println!();
    }
    Ok(())
}

/// Throughput of the multi-row dot (every weight row against `acts` activation
/// rows), the kernel of batched prefill: weight-row x activation-row products per
/// second, as Gelem/s of weights times rows.
fn run_multi(a: &Args, formats: &[GgmlType], min: Duration) -> Result<()> {
    println!(
        "single thread; {} KiB of weights, {} activation rows per call; row {} elements",
        a.bytes >> 10,
        a.acts,
        a.row
    );
    println!("| format | isa | Gelem/s (weights x rows) | weight GB/s |");
    println!("|---|---|---|---|");
    let mut rng = Rng::new(3);
    for &ty in formats {
        let row_bytes = samesum_quant::row_size(ty, a.row)?;
        let rows = (a.bytes / row_bytes).max(1);
        let w = random_weight_blocks(ty, rows * a.row / ty.block_size(), &mut rng)
            .ok_or_else(|| anyhow::anyhow!("no random generator for {ty}"))?;
        let acts: Vec<ActRow> = (0..a.acts)
            .map(|_| {
                let x: Vec<f32> = (0..a.row).map(|_| rng.range(-1.0, 1.0)).collect();
                ActRow::quantize(ty, &x)
            })
            .collect::<std::result::Result<_, _>>()?;
        let mut out = vec![0f32; rows * a.acts];
        for isa in Isa::available() {
            let t = time(min, || {
                dot::dot_rows_multi_with(isa, ty, &w, &acts, &mut out).unwrap();
                black_box(&out);
            });
            let elems = (rows * a.row * a.acts) as f64;
            println!(
                "| {ty} | {isa} | {:.2} | {:.2} |",
                elems / t / 1e9,
                w.len() as f64 / t / 1e9
            );
        }
    }
    Ok(())
}
