//! The `samesum` binary: a thin layer of argument parsing over the library crates.

mod agree;
mod args;
mod bench;
mod bench_quant;
mod identity;
mod inspect;
mod run;
mod serve;
mod synth;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// samesum: Mixture-of-Experts inference from GGUF, where batched prefill computes
/// the same sums as one-token decode.
#[derive(Parser)]
#[command(name = "samesum", version, about, propagate_version = true)]
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
    /// Measure dequantize and dot-product throughput per block format.
    BenchQuant(bench_quant::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (no -m: the built-in
    /// tiny synthetic model).
    Serve(serve::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
        Command::BenchQuant(a) => bench_quant::run(a),
        Command::Serve(a) => serve::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
