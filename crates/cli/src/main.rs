//! The `samesum` binary: a thin layer of argument parsing over the library crates.

mod agree;
mod args;
mod backend;
mod bench;
mod bench_gemm;
mod bench_quant;
mod bench_serve;
mod chat;
mod identity;
mod inspect;
mod perplexity;
mod run;
mod serve;
mod synth;

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::process::ExitCode;

/// samesum: Mixture-of-Experts inference from GGUF, where batched prefill computes
/// the same sums as one-token decode.
#[derive(Parser)]
#[command(
    name = "samesum",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("BUILD_COMMIT"), ")"),
    about,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (no -m: a tiny synthetic model made on the fly).
    Run(run::Args),
    /// The identity gate: replay vs batched prefill, byte for byte.
    Identity(identity::Args),
    /// Teacher-forced agreement of a kernel variant with the default (or of
    /// the default with itself), against a bar.
    Agree(agree::Args),
    /// Write a synthetic random-weight model at a real architecture's shape.
    Synth(synth::Args),
    /// Show a GGUF file's architecture, hyperparameters and tensors (no FILE: the
    /// built-in tiny synthetic model).
    Inspect(inspect::Args),
    /// Measure prompt-processing and generation speed (llama-bench style).
    Bench(bench::Args),
    /// Perplexity of a text file, llama-perplexity's way (no -m: the built-in
    /// tiny synthetic model).
    Perplexity(perplexity::Args),
    /// Measure dequantize and dot-product throughput per block format.
    BenchQuant(bench_quant::Args),
    /// Measure the MoE block's speed per weight format (one layer of a model
    /// shape at each format, its expert matmuls' operations a second).
    BenchGemm(bench_gemm::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (no -m: the built-in
    /// tiny synthetic model).
    Serve(serve::Args),
    /// Load a running OpenAI-compatible server with concurrent streams and
    /// report generated tok/s, per-stream tok/s and time to first token.
    BenchServe(bench_serve::Args),
}

/// llama.cpp's multi-letter single-dash flags, as the long flags clap
/// parses (a short flag is one letter there).
const LLAMA_FLAGS: [(&str, &str); 5] = [
    ("-ngl", "--n-gpu-layers"),
    ("-cnv", "--conversation"),
    ("-fa", "--flash-attn"),
    ("-np", "--parallel"),
    ("-ub", "--ubatch-size"),
];

/// Flags whose value is free text, which is never rewritten.
const TEXT_FLAGS: [&str; 4] = ["-p", "--prompt", "--system", "--text"];

/// The command line with llama.cpp's `-ngl`, `-cnv`, `-fa`, `-np` and `-ub` (alone or as
/// `-ngl=N`) spelled as their long flags; other arguments, and the values of
/// text flags and everything after `--`, as given.
fn llama_spellings(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out: Vec<OsString> = Vec::new();
    let mut verbatim = false;
    for arg in args {
        let after_text_flag = out
            .last()
            .and_then(|p| p.to_str())
            .is_some_and(|p| TEXT_FLAGS.contains(&p));
        if verbatim || after_text_flag {
            out.push(arg);
            continue;
        }
        if arg == "--" {
            verbatim = true;
            out.push(arg);
            continue;
        }
        let mut arg = arg;
        if let Some(s) = arg.to_str() {
            let (flag, value) = match s.split_once('=') {
                Some((f, v)) => (f, Some(v)),
                None => (s, None),
            };
            if let Some((_, long)) = LLAMA_FLAGS.iter().find(|(short, _)| *short == flag) {
                arg = match value {
                    Some(v) => format!("{long}={v}").into(),
                    None => (*long).into(),
                };
            }
        }
        out.push(arg);
    }
    out
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(llama_spellings(std::env::args_os()));
    // Die quietly on a closed pipe (`samesum inspect | head`), as Unix tools
    // do; but not the server, which keeps Rust's default of ignoring SIGPIPE:
    // a streaming client that leaves makes the next write to its socket
    // fail, and hyper's vectored writes raise SIGPIPE for it, which would
    // end the process and every other request with it.
    #[cfg(unix)]
    if !matches!(cli.command, Command::Serve(_)) {
        // SAFETY: restoring the default disposition of SIGPIPE before any
        // threads start (parsing the arguments starts none).
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Identity(a) => identity::run(a),
        Command::Agree(a) => agree::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::BenchQuant(a) => bench_quant::run(a),
        Command::BenchGemm(a) => bench_gemm::run(a),
        Command::Serve(a) => serve::run(a),
        Command::BenchServe(a) => bench_serve::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<run::Interrupted>().is_some() => ExitCode::from(130),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spell(args: &[&str]) -> Vec<String> {
        llama_spellings(args.iter().map(OsString::from))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn llama_flags_become_long_flags() {
        assert_eq!(
            spell(&["samesum", "run", "-ngl", "99", "-fa", "on", "-n", "-1"]),
            [
                "samesum",
                "run",
                "--n-gpu-layers",
                "99",
                "--flash-attn",
                "on",
                "-n",
                "-1"
            ]
        );
        assert_eq!(
            spell(&["samesum", "serve", "-np=4", "-ngl=0", "-ub", "8"]),
            [
                "samesum",
                "serve",
                "--parallel=4",
                "--n-gpu-layers=0",
                "--ubatch-size",
                "8"
            ]
        );
        assert_eq!(
            spell(&["samesum", "run", "-cnv", "-n", "8"]),
            ["samesum", "run", "--conversation", "-n", "8"]
        );
        // Text values and everything after `--` stay as given.
        assert_eq!(
            spell(&[
                "samesum", "run", "-p", "-fa", "--system", "-np", "--", "-ngl"
            ]),
            [
                "samesum", "run", "-p", "-fa", "--system", "-np", "--", "-ngl"
            ]
        );
    }

    #[test]
    fn the_command_line_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
