//! The backend the model thread runs on, as the server sees it. The server
//! knows no device kinds: an [`OpenBackend`] opens the backend on the model
//! thread (a CUDA context belongs to the thread that made it) and hands it
//! to [`ModelThread::run`], which is generic over [`Backend`] and runs the
//! step scheduler on it. `samesum serve` passes its own opener (the CPU or a
//! CUDA device); [`CpuBackend`] opens the CPU backend.

use crate::KvBudget;
use crate::metrics::Metrics;
use crate::scheduler::{self, Job};
use samesum_engine::backend::Backend;
use samesum_engine::cpu::Cpu;
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{KvType, Model};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};

/// Opens the model thread's backend.
pub trait OpenBackend: Send + Sync + std::fmt::Debug {
    /// Open the backend for `model` and call [`ModelThread::run`] with it
    /// (it returns when the server stops); `Err` says why the backend could
    /// not be opened.
    fn open_and_run(&self, model: &Model, thread: ModelThread<'_>) -> Result<(), String>;
}

/// Where a backend keeps the KV cache: what `--kv-budget auto` is a share of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory (the CPU backend).
    Host,
    /// A device's memory: its free and total bytes with the weights placed
    /// (`None` where the driver does not say).
    Device(Option<(u64, u64)>),
}

/// What an opened backend tells the server.
#[derive(Clone, Debug)]
pub struct Opened {
    /// The backend's name (as [`Backend::name`]).
    pub name: String,
    /// Where the weights went, logged at start (`None`: nothing to say).
    pub placement: Option<String>,
    /// Where the KV cache lives.
    pub memory: Memory,
    /// The most prompt rows a step may carry on this backend (`None`: as
    /// configured). CUDA's tier mode sizes its activations for its own
    /// batch inside the VRAM its plan leaves, so a larger configured chunk is
    /// cut to it.
    pub max_chunk: Option<usize>,
}

/// Prompt rows a scheduler step carries: the configured chunk, cut to the
/// backend's most where it has one.
pub(crate) fn step_chunk(configured: usize, max: Option<usize>) -> usize {
    max.map_or(configured, |m| configured.min(m)).max(1)
}

/// Sent once by the model thread: the backend's name and the KV budget, or
/// why it could not start.
pub(crate) type Ready = Result<(String, Option<u64>), String>;

/// The model thread's work once its backend is open: resolve the KV budget,
/// report ready, run the step scheduler until the request queue closes.
pub struct ModelThread<'a> {
    pub(crate) model: &'a Model,
    pub(crate) tok: Arc<Tokenizer>,
    pub(crate) rx: Receiver<Job>,
    pub(crate) cfg: scheduler::Config,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) ready: Sender<Ready>,
    pub(crate) budget: KvBudget,
    pub(crate) kv: KvType,
    pub(crate) ctx: usize,
}

impl ModelThread<'_> {
    /// Serve on `b` until the server stops.
    pub fn run<B: Backend>(self, b: &B, opened: Opened) {
        if let Some(p) = &opened.placement {
            tracing::info!("{p}");
        }
        let mut cfg = self.cfg;
        let chunk = step_chunk(cfg.prefill_chunk, opened.max_chunk);
        if chunk != cfg.prefill_chunk {
            tracing::info!(
                "prompt rows a step: {chunk}, the backend's most (asked for {})",
                cfg.prefill_chunk
            );
            cfg.prefill_chunk = chunk;
        }
        let (kv_budget, note) = self.budget.resolve(opened.memory, cfg.prefix_cache_bytes);
        tracing::info!("KV budget: {note}");
        let one = samesum_engine::sched::context_bytes(&self.model.hp, self.kv, self.ctx);
        if kv_budget.is_some_and(|bytes| bytes < one) {
            tracing::warn!(
                "the KV budget is below one request of the whole context ({one} bytes at --ctx-size {}): longer requests are refused",
                self.ctx
            );
        }
        cfg.kv_budget = kv_budget;
        let _ = self.ready.send(Ok((opened.name, kv_budget)));
        scheduler::run(self.model, &self.tok, b, self.rx, &cfg, &self.metrics);
    }
}

/// The CPU backend with this many threads (0: all cores).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuBackend(pub usize);

impl OpenBackend for CpuBackend {
    fn open_and_run(&self, _model: &Model, thread: ModelThread<'_>) -> Result<(), String> {
        let cpu = Cpu::new(self.0);
        let opened = Opened {
            name: cpu.name(),
            placement: None,
            memory: Memory::Host,
            max_chunk: None,
        };
        thread.run(&cpu, opened);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::step_chunk;

    #[test]
    fn a_backend_cap_cuts_the_configured_chunk_only_when_smaller() {
        assert_eq!(step_chunk(2048, None), 2048);
        assert_eq!(step_chunk(2048, Some(512)), 512);
        assert_eq!(step_chunk(128, Some(512)), 128);
        assert_eq!(step_chunk(0, None), 1);
        assert_eq!(step_chunk(64, Some(0)), 1);
    }
}
