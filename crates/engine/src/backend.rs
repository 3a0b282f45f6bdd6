//! The backend interface: the operations the forward pass needs, at the
//! granularity the model needs, over `m` rows at a time.
//!
//! The row contract: every op computes each output row with arithmetic that
//! depends only on that row's inputs (and, for attention, the short conv and the
//! delta rule, on the earlier positions of its own sequence, read from the state
//! its own earlier rows wrote): never on how many rows are in the call, where the
//! row sits in it, the other rows' values, or the number of threads. Decode is
//! the forward pass with `m = 1`; batched prefill is the same forward with
//! `m = chunk`, so identity holds by construction when every op obeys it.
//!
//! Buffers (`Buf`) are row-major `m x width` f32 arrays resident where the backend
//! computes; sequence state (`State`) holds the KV cache and the delta-net
//! states. Weights are referenced through the host [`Model`] (names, geometry);
//! a device backend keeps its own resident copies keyed by them.

use crate::error::Result;
use crate::model::Model;
use crate::model::weights::{AttentionW, DeltaNetW, MoeW};
use crate::state::KvType;

/// Which RMSNorm weight vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// Layer `l`'s pre-mixer norm.
    Attn(usize),
    /// Layer `l`'s pre-MoE norm.
    Ffn(usize),
    /// The final norm.
    Output,
}

impl Norm {
    /// The norm's weight vector in `model`.
    pub fn weight(self, model: &Model) -> &[f32] {
        match self {
            Norm::Attn(l) => &model.w.layers[l].attn_norm,
            Norm::Ffn(l) => &model.w.layers[l].ffn_norm,
            Norm::Output => &model.w.output_norm,
        }
    }
}

/// Cumulative counters of weights brought to the device on demand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadCounters {
    /// Decode-cache lookups that found the expert on the device.
    pub hits: u64,
    /// Decode-cache lookups that copied the expert in.
    pub misses: u64,
    /// Bytes copied into the decode cache.
    pub fetched_bytes: u64,
    /// Bytes copied into the prefill staging buffers.
    pub staged_bytes: u64,
}

impl OffloadCounters {
    /// The counts since `earlier`.
    pub fn since(&self, earlier: &OffloadCounters) -> OffloadCounters {
        OffloadCounters {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            fetched_bytes: self.fetched_bytes - earlier.fetched_bytes,
            staged_bytes: self.staged_bytes - earlier.staged_bytes,
        }
    }

    /// Hits over lookups (0 without lookups).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// A sequence's one-token decode step on a backend that records steps: its
/// buffers (the embedded row and two scratch rows, at fixed addresses so a
/// recording can replay on them) and its recording. Kept in the sequence's
/// state by the backend ([`Backend::take_step`], [`Backend::put_step`]);
/// driven by [`crate::forward::decode_step`].
pub struct DecodeStep<B: Backend + ?Sized> {
    /// The embedded row, updated in place by the layers.
    pub h: B::Buf,
    /// Scratch row.
    pub x: B::Buf,
    /// Scratch row.
    pub y: B::Buf,
    /// The recorded step, once recorded.
    pub graph: Option<B::Graph>,
    /// Steps run call by call so far (the first one is, so everything the
    /// step needs is loaded before recording).
    pub eager_steps: usize,
    /// Recording failed once: this sequence's steps run call by call.
    pub no_graph: bool,
}

/// A decode step of several sequences, a row each, that the backend runs
/// recorded ([`Backend::seqs_step`]): `rows` rows, the sequences' rows
/// first, then padding rows (token 0, their results never read, writing
/// only the backend's own scratch state), and the key of the recording
/// that serves it. Steps of the same key replay one recording whichever
/// sequences fill its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqsStep {
    /// Which recording (and row buffers) serves the step.
    pub key: u64,
    /// Rows the step runs: at least the sequences.
    pub rows: usize,
}

/// The error of the recording calls on a backend that records no steps.
fn not_recording() -> crate::EngineError {
    crate::EngineError::Device {
        backend: "engine",
        op: "record a step".into(),
        msg: "this backend does not record steps".into(),
    }
}

/// One mixer call per sequence over its own rows of `x` (the default of the
/// `*_seqs` methods).
fn per_sequence<B: Backend + ?Sized>(
    b: &B,
    model: &Model,
    x: &B::Buf,
    sts: &mut [&mut B::State],
    rows: &[usize],
    y: &mut B::Buf,
    f: impl Fn(&B, &B::Buf, &mut B::State, &mut B::Buf) -> Result<()>,
) -> Result<()> {
    let d = model.hp.n_embd;
    let mut r0 = 0;
    for (st, &n) in sts.iter_mut().zip(rows) {
        if n == 0 {
            continue;
        }
        let xs = b.rows(x, d, r0, n)?;
        let mut ys = b.alloc(n * d)?;
        f(b, &xs, st, &mut ys)?;
        b.set_rows(y, d, r0, &ys)?;
        r0 += n;
    }
    Ok(())
}

/// A compute backend.
pub trait Backend: Sync {
    /// Row-major f32 rows on the backend's device.
    type Buf;
    /// One sequence's state (KV cache, conv and delta-rule states, position).
    type State;
    /// A recorded decode step ([`Backend::begin_recording`]); `()` for a
    /// backend that records none.
    type Graph;

    /// A name for tables and logs.
    fn name(&self) -> String;
    /// A zeroed buffer of `n` values.
    fn alloc(&self, n: usize) -> Result<Self::Buf>;
    /// A buffer holding `host`.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// Copy a buffer to the host.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Empty state for `ctx` tokens.
    fn new_state(&self, model: &Model, ctx: usize, kv: KvType) -> Result<Self::State>;
    /// The next position of a sequence.
    fn position(&self, st: &Self::State) -> usize;
    /// The context size of a sequence.
    fn capacity(&self, st: &Self::State) -> usize;
    /// A sequence's state as host values: position, the KV rows written so far,
    /// conv and delta-rule states (for comparing two runs bit for bit).
    fn download_state(&self, st: &Self::State) -> Result<Vec<f32>>;
    /// Make a sequence's next `m` positions writable before a forward call
    /// writes them (the forward functions call it first). A paged cache
    /// allocates the blocks they fall in and copies those a fork shares;
    /// a recorded step then replays over them. Default: nothing (the CPU
    /// allocates as it writes).
    fn reserve(&self, st: &mut Self::State, m: usize) -> Result<()> {
        let _ = (st, m);
        Ok(())
    }
    /// Move a sequence past `m` rows (after a forward call wrote them).
    fn advance(&self, st: &mut Self::State, m: usize);
    /// A copy of a sequence's state with a context of `ctx` tokens (at least
    /// its position): the same position, the same KV rows `0..pos` and the
    /// same conv and delta-rule states, so feeding both the same tokens
    /// gives the same bytes, and writing to one leaves the other unchanged.
    /// Nothing recorded for the original's decode steps comes along (the
    /// copy records its own). Errors when `ctx` is below the position or the
    /// copy cannot be allocated.
    fn fork_state(&self, st: &Self::State, ctx: usize) -> Result<Self::State>;

    /// Rows `r0..r0 + n` of `x` (rows of `width`) as a new buffer.
    fn rows(&self, x: &Self::Buf, width: usize, r0: usize, n: usize) -> Result<Self::Buf>;
    /// Copy `src` (rows of `width`) into rows `r0..` of `dst`.
    fn set_rows(&self, dst: &mut Self::Buf, width: usize, r0: usize, src: &Self::Buf)
    -> Result<()>;

    /// Embedding rows of `tokens` (errors on ids outside the vocabulary).
    fn embed(&self, model: &Model, tokens: &[u32], out: &mut Self::Buf) -> Result<()>;
    /// RMSNorm rows with weight `which`.
    fn rms_norm(
        &self,
        model: &Model,
        which: Norm,
        x: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `acc += x`, element-wise.
    fn add(&self, acc: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// `acc += x`, then `out` = RMSNorm of the new `acc` rows with weight
    /// `which`: exactly [`Backend::add`] then [`Backend::rms_norm`] (a
    /// backend may do both in one pass, with the same arithmetic).
    fn add_rms_norm(
        &self,
        model: &Model,
        which: Norm,
        acc: &mut Self::Buf,
        x: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()> {
        self.add(acc, x)?;
        self.rms_norm(model, which, acc, out)
    }
    /// Gated/plain attention rows of layer `l` over the KV cache (projections,
    /// head norms, RoPE, cache write, attention in key order, output gate,
    /// output projection); rows are the state's next positions, in order.
    fn attention(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &Self::Buf,
        st: &mut Self::State,
        y: &mut Self::Buf,
    ) -> Result<()>;
    /// Gated delta-net rows of layer `l` (projections, causal conv with state,
    /// delta rule with state, gated norm, output projection), rows in order.
    fn delta_net(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &Self::Buf,
        st: &mut Self::State,
        y: &mut Self::Buf,
    ) -> Result<()>;
    /// [`Backend::attention`] for several sequences in one call: `x` holds
    /// `rows[i]` rows of sequence `sts[i]` after each other (sequences with
    /// no rows hold none), `y` receives their outputs in the same order.
    /// Each sequence's rows get the bytes of a call of their own (the row
    /// contract); a backend may run the projections of all rows at once,
    /// and the sequences of one row each that lead the call in one launch
    /// per op (so callers put decode rows first). The default makes one
    /// call per sequence.
    #[allow(clippy::too_many_arguments)]
    fn attention_seqs(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &Self::Buf,
        sts: &mut [&mut Self::State],
        rows: &[usize],
        y: &mut Self::Buf,
    ) -> Result<()> {
        per_sequence(self, model, x, sts, rows, y, |b, x, st, y| {
            b.attention(model, l, a, x, st, y)
        })
    }
    /// [`Backend::delta_net`] for several sequences in one call, as
    /// [`Backend::attention_seqs`].
    #[allow(clippy::too_many_arguments)]
    fn delta_net_seqs(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &Self::Buf,
        sts: &mut [&mut Self::State],
        rows: &[usize],
        y: &mut Self::Buf,
    ) -> Result<()> {
        per_sequence(self, model, x, sts, rows, y, |b, x, st, y| {
            b.delta_net(model, l, dn, x, st, y)
        })
    }
    /// MoE rows: router softmax/top-k (lowest id wins ties), each chosen expert's
    /// FFN, the combination in k order, plus the sigmoid-gated shared expert.
    fn moe(&self, model: &Model, mw: &MoeW, x: &Self::Buf, y: &mut Self::Buf) -> Result<()>;
    /// The MoE block of normed rows `x` into `y`, then the residual add and
    /// the next norm: `h += y`, `x` = RMSNorm(h) with weight `which`; exactly
    /// [`Backend::moe`] then [`Backend::add_rms_norm`] (a backend may fuse
    /// the MoE's last step with the add and norm, with the same arithmetic).
    fn moe_add_rms_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        h: &mut Self::Buf,
        x: &mut Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()> {
        self.moe(model, mw, x, y)?;
        self.add_rms_norm(model, which, h, y, x)
    }
    /// Wait until every call made so far has finished: a device backend's
    /// calls may return before the device ran them, so a timer started
    /// after them would count their work (the default: nothing to wait for).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Backend-specific measurements since the last call (a per-kernel time
    /// table on the GPU when profiling is on), as Markdown; `None` if it has none.
    fn take_report(&self) -> Result<Option<String>> {
        Ok(None)
    }
    /// Counters of a backend that keeps some weights off the device (the
    /// CUDA backend's tier mode); `None` for one that keeps them all resident.
    fn offload_counters(&self) -> Option<OffloadCounters> {
        None
    }
    /// Whether one-token steps are recorded once and replayed (see
    /// [`crate::forward::decode_step`]); `false` (the default) runs each
    /// step's calls one by one.
    fn records_steps(&self) -> bool {
        false
    }
    /// The buffers and recording of a sequence's decode step, kept in its
    /// state between steps (`None` before the first).
    fn take_step(&self, _st: &mut Self::State) -> Option<DecodeStep<Self>> {
        None
    }
    /// Keep a sequence's decode step in its state for the next one.
    fn put_step(&self, _st: &mut Self::State, _step: DecodeStep<Self>) {}
    /// Record the calls that follow on `st` instead of running them, until
    /// [`Backend::end_recording`]. Only called when
    /// [`Backend::records_steps`] is true.
    fn begin_recording(&self, _st: &mut Self::State) -> Result<()> {
        Err(not_recording())
    }
    /// End a recording: the recorded calls as one replayable step. Called
    /// after every [`Backend::begin_recording`], also when a recorded call
    /// failed.
    fn end_recording(&self, _st: &mut Self::State) -> Result<Self::Graph> {
        Err(not_recording())
    }
    /// Run a recorded step on `st` (at its current position).
    fn replay(&self, _st: &mut Self::State, _g: &Self::Graph) -> Result<()> {
        Err(not_recording())
    }
    /// How a decode step of `sts` (a row each, at least two sequences)
    /// runs recorded: its rows and recording key; `None` (the default) runs
    /// it call by call. Only asked when [`Backend::records_steps`] is true.
    fn seqs_step(&self, _model: &Model, _sts: &[&Self::State]) -> Option<SeqsStep> {
        None
    }
    /// The row buffers and recording of the multi-sequence step `key`,
    /// kept by the backend between steps (`None` before the first).
    fn take_seqs_step(&self, _key: u64) -> Option<DecodeStep<Self>> {
        None
    }
    /// Keep the multi-sequence step `key` for the next step of that key.
    fn put_seqs_step(&self, _key: u64, _step: DecodeStep<Self>) {}
    /// Bind `sts` to `step`'s rows: their caches, states and positions go
    /// where the step's kernels read them (padding rows after them). Until
    /// [`Backend::unbind_seqs`], [`Backend::attention_seqs`] and
    /// [`Backend::delta_net_seqs`] run `step.rows` rows of `x`, one a
    /// sequence, through that binding, and recorded steps replay on it.
    fn bind_seqs(&self, _model: &Model, _step: SeqsStep, _sts: &[&Self::State]) -> Result<()> {
        Err(not_recording())
    }
    /// End a binding of [`Backend::bind_seqs`] (also after a failed step).
    fn unbind_seqs(&self) {}
    /// Record the calls that follow for the bound multi-sequence step,
    /// until [`Backend::end_recording_seqs`].
    fn begin_recording_seqs(&self) -> Result<()> {
        Err(not_recording())
    }
    /// End a multi-sequence recording (also when a recorded call failed).
    fn end_recording_seqs(&self) -> Result<Self::Graph> {
        Err(not_recording())
    }
    /// Run a recorded multi-sequence step on the bound sequences.
    fn replay_seqs(&self, _g: &Self::Graph) -> Result<()> {
        Err(not_recording())
    }
    /// Final norm and LM head for `rows` of `h`, to host logits.
    fn logits(&self, model: &Model, h: &Self::Buf, rows: &[usize]) -> Result<Vec<f32>>;
    /// Each of `rows`' most likely token: [`crate::sample::argmax`] of the
    /// logits [`Backend::logits`] computes, exactly (a device backend may
    /// pick on the device and return only the ids).
    fn logits_argmax(&self, model: &Model, h: &Self::Buf, rows: &[usize]) -> Result<Vec<u32>> {
        let l = self.logits(model, h, rows)?;
        Ok(l.chunks(model.w.n_vocab.max(1))
            .map(crate::sample::argmax)
            .collect())
    }
    /// Lanes: how many consecutive prefill chunks of one sequence this
    /// backend can run at once ([`crate::forward::forward_pair`]), each on a
    /// lane of its own, the later chunk's layer `l` ordered after the earlier
    /// chunk's. 1 (the default): one after another.
    fn lanes(&self) -> usize {
        1
    }
    /// Send later calls to `lane`, for rows that start at position `pos` of
    /// `st` (its position while the lane's chunk runs). Only called when
    /// [`Backend::lanes`] is above 1.
    fn enter_lane(&self, _st: &mut Self::State, _lane: usize, _pos: usize) -> Result<()> {
        Ok(())
    }
    /// Mark the point the current lane has reached: its layer `layer` is
    /// issued (what [`Backend::lane_wait`] on another lane waits for).
    fn lane_mark(&self, _layer: usize) -> Result<()> {
        Ok(())
    }
    /// Make the current lane wait until `lane` has finished what it had
    /// issued when it marked `layer`.
    fn lane_wait(&self, _lane: usize, _layer: usize) -> Result<()> {
        Ok(())
    }
}
