//! `samesum perplexity`: llama-perplexity's measurement on a text file.
//!
//! The text is tokenized (with a BOS first where the model adds one), cut
//! into chunks of `-c` tokens, and each chunk runs through a fresh sequence
//! in one batched prefill (its first token replaced by BOS where the model
//! adds one, as llama.cpp does). The second half of each chunk is scored:
//! token `i` for `i` from `c/2 + 1` to `c - 1`, given the tokens before it
//! (`samesum_engine::score`). The running estimate `exp(mean NLL)` after each
//! chunk prints as `[1]12.3456,[2]11.2345,...`; the end prints
//! `Final estimate: PPL = X +/- Y`, Y being llama-perplexity's standard error
//! `ppl * sqrt((mean(nll^2) - mean(nll)^2) / (n - 1))`.

use crate::args::{BackendArgs, ChunkArgs, KvArgs, ModelArgs, ThreadsArgs};
use crate::with_backend;
use anyhow::{Context, Result, bail};
use samesum_engine::score::score_tokens;
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{Backend, KvType, Model};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `samesum perplexity`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to measure (a UTF-8 file of at least two chunks' worth of
    /// tokens).
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    /// Tokens a chunk (llama-perplexity's -c; the second half of each chunk
    /// is scored).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512,
          value_parser = clap::value_parser!(u64).range(4..=1 << 24))]
    ctx: u64,
    /// Measure at most this many chunks (default: every whole chunk).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    chunks: Option<u64>,
    /// Print one JSON object instead of the text lines.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    threads: ThreadsArgs,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    chunk: ChunkArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

/// Running sums of negative log-likelihoods.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Nll {
    sum: f64,
    sum2: f64,
    count: u64,
}

impl Nll {
    fn add(&mut self, logprob: f64) {
        self.sum -= logprob;
        self.sum2 += logprob * logprob;
        self.count += 1;
    }

    /// `exp(mean NLL)`.
    fn ppl(&self) -> f64 {
        (self.sum / self.count.max(1) as f64).exp()
    }

    /// llama-perplexity's standard error of the estimate (0 when it has no
    /// spread to measure).
    fn stderr(&self) -> f64 {
        if self.count < 2 {
            return 0.0;
        }
        let n = self.count as f64;
        let (mean, mean2) = (self.sum / n, self.sum2 / n);
        let var = mean2 - mean * mean;
        if var > 0.0 {
            (var / (n - 1.0)).sqrt() * self.ppl()
        } else {
            0.0
        }
    }
}

pub(crate) fn run(a: Args) -> Result<()> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading the text file {}", a.file.display()))?;
    let dev = a.backend.device(a.threads.threads)?;
    let kv = a.kv.kv(&dev)?;
    let (path, _tmp) = a.model.path_or_synth(
        "tiny-qwen3next",
        "q8_0",
        Some("(no -m given: measuring the tiny synthetic qwen3next model with random weights)"),
    )?;
    let model = Model::load(&path)?;
    let tok = Tokenizer::from_metadata(model.file.metadata())?;
    let tokens = tok.encode(&text)?;
    let n_ctx = usize::try_from(a.ctx).unwrap_or(usize::MAX);
    if tokens.len() / 2 < n_ctx {
        bail!(
            "{} has {} tokens; perplexity with -c {n_ctx} needs at least {} (two chunks): give a longer text or a smaller -c",
            a.file.display(),
            tokens.len(),
            2 * n_ctx
        );
    }
    let trained = model.hp.n_ctx_train;
    if n_ctx > trained {
        eprintln!("warning: -c {n_ctx} is above the model's trained context of {trained} tokens");
    }
    let whole = tokens.len() / n_ctx;
    let n_chunks = a.chunks.map_or(whole, |c| {
        whole.min(usize::try_from(c).unwrap_or(usize::MAX))
    });
    let backend = crate::args::open(dev, &model)?;
    let chunk = a.chunk.or_default(&backend);
    eprintln!(
        "perplexity: {} tokens of {}, {n_chunks} chunks of {n_ctx} (scoring the last {} of each), model {}",
        tokens.len(),
        a.file.display(),
        n_ctx - 1 - n_ctx / 2,
        path.display()
    );
    let t0 = Instant::now();
    let job = Job {
        tokens: &tokens,
        bos: tok.bos.filter(|_| tok.add_bos),
        n_ctx,
        n_chunks,
        chunk,
        kv,
        echo: !a.json,
    };
    let (nll, estimates) = with_backend!(&backend, |b| job.run(b, &model))?;
    let secs = t0.elapsed().as_secs_f64();
    let (ppl, err) = (nll.ppl(), nll.stderr());
    if a.json {
        let out = json!({
            "model": path.display().to_string(),
            "file": a.file.display().to_string(),
            "tokens": tokens.len(),
            "ctx": n_ctx,
            "chunks": n_chunks,
            "scored": nll.count,
            "estimates": estimates,
            "ppl": ppl,
            "ppl_stderr": err,
            "mean_nll": nll.sum / nll.count.max(1) as f64,
            "seconds": secs,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("Final estimate: PPL = {ppl:.4} +/- {err:.5}");
        eprintln!(
            "perplexity: {} tokens scored in {secs:.2}s ({:.1} tok/s)",
            nll.count,
            (n_chunks * n_ctx) as f64 / secs.max(1e-9)
        );
    }
    Ok(())
}

/// The measurement over the chunks.
struct Job<'a> {
    tokens: &'a [u32],
    bos: Option<u32>,
    n_ctx: usize,
    n_chunks: usize,
    chunk: usize,
    kv: KvType,
    /// Print the running estimate after each chunk (stdout).
    echo: bool,
}

impl Job<'_> {
    fn run<B: Backend>(&self, b: &B, model: &Model) -> Result<(Nll, Vec<f64>)> {
        let mut nll = Nll::default();
        let mut estimates = Vec::with_capacity(self.n_chunks);
        let mut out = std::io::stdout().lock();
        let first = self.n_ctx / 2 + 1;
        for i in 0..self.n_chunks {
            let mut c = self.tokens[i * self.n_ctx..(i + 1) * self.n_ctx].to_vec();
            if let Some(bos) = self.bos {
                c[0] = bos;
            }
            for s in score_tokens(b, model, &c, first, self.chunk, self.kv, 0)? {
                nll.add(s.logprob);
            }
            estimates.push(nll.ppl());
            if self.echo {
                write!(out, "[{}]{:.4},", i + 1, nll.ppl())?;
                out.flush()?;
            }
        }
        if self.echo {
            writeln!(out)?;
        }
        Ok((nll, estimates))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_and_standard_error_follow_llama_perplexity() {
        let lp = [-1.0f64, -2.0, -0.5, -3.0];
        let mut n = Nll::default();
        for &l in &lp {
            n.add(l);
        }
        let mean = 6.5 / 4.0;
        assert!((n.ppl() - f64::exp(mean)).abs() < 1e-12);
        let var = (1.0 + 4.0 + 0.25 + 9.0) / 4.0 - mean * mean;
        let want = (var / 3.0).sqrt() * f64::exp(mean);
        assert!((n.stderr() - want).abs() < 1e-12);
        let mut one = Nll::default();
        one.add(-1.0);
        assert_eq!(one.stderr(), 0.0);
    }
}
