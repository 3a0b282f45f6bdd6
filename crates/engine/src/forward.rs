//! The forward pass, written once for `m` rows against the [`Backend`] interface:
//! decode is `m = 1`, prefill is the same code with `m = chunk`. Nothing here
//! knows which one it is, or which backend runs it.
//!
//! Per layer: RMSNorm -> mixer (attention or gated delta net) -> residual ->
//! RMSNorm -> MoE (router, top-k experts combined in k order, shared expert) ->
//! residual; then the final norm and the LM head for the rows whose logits are
//! wanted.

use crate::backend::{Backend, DecodeStep, Norm};
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::model::weights::Mixer;

/// Prompt rows per forward call in batched prefill unless told otherwise:
/// measured on the CPU (docs/BENCHMARKS-CPU.md: pp512 with 2 threads on
/// qwen35moe-35b-a3b at 8 layers, 128: 210, 256: 236, 512: 232 tok/s).
pub const DEFAULT_CHUNK: usize = 256;

/// Which rows' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every row's (`m * n_vocab` values).
    All,
    /// The last row's only.
    Last,
    /// The last row's most likely token only (the lowest id among equal
    /// largest logits, [`crate::sample::argmax`]'s pick), not its logits: a
    /// backend may pick it where the logits are and return one id
    /// ([`Backend::logits_argmax`]). [`forward_batch`] returns it as
    /// [`BatchLogits::token`] (and [`forward`] no logits); the prefill
    /// helpers (`prefill`, `forward_chunks`, `forward_pair`) read it as
    /// [`Logits::Last`].
    Greedy,
    /// None (state update only).
    None,
}

impl Logits {
    /// The rows it asks of a call's `n` rows that start at row `r0`.
    pub fn rows(self, r0: usize, n: usize) -> std::ops::Range<usize> {
        match self {
            Logits::All => r0..r0 + n,
            Logits::Last | Logits::Greedy if n > 0 => r0 + n - 1..r0 + n,
            _ => r0..r0,
        }
    }
}

/// One sequence's part of a batched forward call: its state, its next tokens
/// and which of their logits to return.
pub struct Segment<'a, S> {
    /// The sequence's state (its next positions receive `tokens`).
    pub state: &'a mut S,
    /// Tokens to run.
    pub tokens: &'a [u32],
    /// Which rows' logits to return.
    pub want: Logits,
}

/// Run `tokens` (at the state's next positions) through the model, update the
/// state, and return the requested logits.
pub fn forward<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    tokens: &[u32],
    want: Logits,
) -> Result<Vec<f32>> {
    let mut segs = [Segment {
        state: st,
        tokens,
        want,
    }];
    Ok(forward_batch(model, b, &mut segs)?.into_first())
}

/// The logits of a [`forward_batch`] call: every segment's requested rows
/// in one buffer, as the backend returned them (a step of many sequences
/// over a large vocabulary is tens of megabytes; no per-segment copies).
/// `logits[i]` and [`BatchLogits::iter`] give segment `i`'s rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchLogits {
    data: Vec<f32>,
    /// Segment i's values end at `ends[i]` (and start at `ends[i - 1]`).
    ends: Vec<usize>,
    /// Segment i's most likely token where it asked for [`Logits::Greedy`].
    tokens: Vec<Option<u32>>,
}

impl BatchLogits {
    /// Segment `i`'s most likely token, where it asked for
    /// [`Logits::Greedy`] (its logits are then empty).
    pub fn token(&self, i: usize) -> Option<u32> {
        self.tokens.get(i).copied().flatten()
    }

    /// How many segments.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are no segments.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Each segment's logits, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[f32]> {
        (0..self.len()).map(|i| &self[i])
    }

    /// The first segment's logits, owned (the whole buffer when there is
    /// one segment: no copy); empty when there are none.
    pub fn into_first(mut self) -> Vec<f32> {
        match self.ends.first() {
            None => Vec::new(),
            Some(&end) => {
                self.data.truncate(end);
                self.data
            }
        }
    }
}

impl std::ops::Index<usize> for BatchLogits {
    type Output = [f32];
    fn index(&self, i: usize) -> &[f32] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.data[start..self.ends[i]]
    }
}

impl<'a> IntoIterator for &'a BatchLogits {
    type Item = &'a [f32];
    type IntoIter = Box<dyn Iterator<Item = &'a [f32]> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// Several sequences in one forward call: their rows go through the norms and
/// the MoE together (one expert plan for all of them), each sequence's rows
/// through the mixer with its own state. By the row contract each sequence
/// gets the same bytes as in a call of its own. Returns each segment's logits.
pub fn forward_batch<B: Backend>(
    model: &Model,
    b: &B,
    segs: &mut [Segment<'_, B::State>],
) -> Result<BatchLogits> {
    let d = model.hp.n_embd;
    let m: usize = segs.iter().map(|s| s.tokens.len()).sum();
    if m == 0 {
        return Ok(BatchLogits {
            data: Vec::new(),
            ends: vec![0; segs.len()],
            tokens: vec![None; segs.len()],
        });
    }
    for s in segs.iter_mut() {
        let (pos, n) = (b.position(s.state), s.tokens.len());
        if pos + n > b.capacity(s.state) {
            return Err(EngineError::ContextFull {
                pos: pos + n - 1,
                ctx: b.capacity(s.state),
            });
        }
        b.reserve(s.state, n)?;
    }
    if let [seg] = &mut *segs
        && let [token] = seg.tokens
        && b.records_steps()
    {
        return decode_step(model, b, seg.state, *token, seg.want);
    }
    if segs.len() > 1 && segs.iter().all(|s| s.tokens.len() == 1) && b.records_steps() {
        let sts: Vec<&B::State> = segs.iter().map(|s| &*s.state).collect();
        if let Some(plan) = b.seqs_step(model, &sts) {
            return decode_seqs_step(model, b, segs, plan);
        }
    }
    let tokens: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
    let mut h = b.alloc(m * d)?;
    b.embed(model, &tokens, &mut h)?;
    let mut x = b.alloc(m * d)?;
    let mut y = b.alloc(m * d)?;
    if let [seg] = &mut *segs {
        layers_one(model, b, seg.state, &mut h, &mut x, &mut y)?;
    } else {
        let rows: Vec<usize> = segs.iter().map(|s| s.tokens.len()).collect();
        let mut sts: Vec<&mut B::State> = segs.iter_mut().map(|s| &mut *s.state).collect();
        layers_seqs(model, b, &mut sts, &rows, &mut h, &mut x, &mut y)?;
    }
    advance_and_read(model, b, segs, &h)
}

/// The layer stack over several sequences' rows (`rows[i]` consecutive
/// rows of `h` for `sts[i]`): each mixer over all of them in one call
/// ([`Backend::attention_seqs`], [`Backend::delta_net_seqs`]), the norms and
/// the MoE over all rows.
fn layers_seqs<B: Backend>(
    model: &Model,
    b: &B,
    sts: &mut [&mut B::State],
    rows: &[usize],
    h: &mut B::Buf,
    x: &mut B::Buf,
    y: &mut B::Buf,
) -> Result<()> {
    let n_layers = model.w.layers.len();
    for (l, lw) in model.w.layers.iter().enumerate() {
        if l == 0 {
            b.rms_norm(model, Norm::Attn(l), h, x)?;
        }
        match &lw.mixer {
            Mixer::Attention(a) => b.attention_seqs(model, l, a, x, sts, rows, y)?,
            Mixer::Linear(dn) => b.delta_net_seqs(model, l, dn, x, sts, rows, y)?,
        }
        b.add_rms_norm(model, Norm::Ffn(l), h, y, x)?;
        // The residual add, fused with the next layer's input norm.
        if l + 1 < n_layers {
            b.moe_add_rms_norm(model, &lw.moe, Norm::Attn(l + 1), h, x, y)?;
        } else {
            b.moe(model, &lw.moe, x, y)?;
            b.add(h, y)?;
        }
    }
    Ok(())
}

/// After the layers ran the segments' rows (in order, from row 0 of `h`;
/// rows after them are ignored): move each state past its rows and return
/// the logits and greedy picks the segments ask for.
fn advance_and_read<B: Backend>(
    model: &Model,
    b: &B,
    segs: &mut [Segment<'_, B::State>],
    h: &B::Buf,
) -> Result<BatchLogits> {
    let (mut rows, mut greedy) = (Vec::new(), Vec::new());
    let mut r0 = 0;
    for s in segs.iter_mut() {
        let n = s.tokens.len();
        b.advance(s.state, n);
        match s.want {
            Logits::Greedy => greedy.extend(s.want.rows(r0, n)),
            w => rows.extend(w.rows(r0, n)),
        }
        r0 += n;
    }
    let logits = if rows.is_empty() {
        Vec::new()
    } else {
        b.logits(model, h, &rows)?
    };
    let picked = if greedy.is_empty() {
        Vec::new()
    } else {
        b.logits_argmax(model, h, &greedy)?
    };
    if picked.len() != greedy.len() {
        return Err(picked_count(picked.len(), greedy.len()));
    }
    let mut picked = picked.into_iter();
    let v = model.w.n_vocab;
    let mut ends = Vec::with_capacity(segs.len());
    let mut tokens = Vec::with_capacity(segs.len());
    let mut at = 0;
    for s in segs.iter() {
        let k = s.want.rows(0, s.tokens.len()).len();
        match s.want {
            Logits::Greedy if k > 0 => tokens.push(picked.next()),
            Logits::Greedy => tokens.push(None),
            _ => {
                at += k * v;
                tokens.push(None);
            }
        }
        ends.push(at);
    }
    if logits.len() != at {
        return Err(logits_mismatch(format!(
            "the backend returned {} values for {} rows of {v}",
            logits.len(),
            at / v.max(1)
        )));
    }
    Ok(BatchLogits {
        data: logits,
        ends,
        tokens,
    })
}

/// A decode step of several sequences (a row each) as the backend records
/// it ([`Backend::seqs_step`]): the rows' buffers and recording of the
/// step's key, the sequences bound to its rows ([`Backend::bind_seqs`]),
/// then as [`decode_step`]: the first step of a key runs call by call, the
/// second is recorded and replayed, later ones replay. Padding rows run
/// token 0 on the backend's scratch state; only the sequences' rows are
/// read. Each row computes what it computes in any other step (the row
/// contract), so the bytes are those of [`forward_batch`] without
/// recording.
fn decode_seqs_step<B: Backend>(
    model: &Model,
    b: &B,
    segs: &mut [Segment<'_, B::State>],
    plan: crate::backend::SeqsStep,
) -> Result<BatchLogits> {
    if plan.rows < segs.len() {
        return Err(EngineError::Device {
            backend: "engine",
            op: "a recorded step of several sequences".into(),
            msg: format!("{} rows for {} sequences", plan.rows, segs.len()),
        });
    }
    let d = model.hp.n_embd;
    let mut step = match b.take_seqs_step(plan.key) {
        Some(s) => s,
        None => DecodeStep {
            h: b.alloc(plan.rows * d)?,
            x: b.alloc(plan.rows * d)?,
            y: b.alloc(plan.rows * d)?,
            graph: None,
            eager_steps: 0,
            no_graph: false,
        },
    };
    let ran = {
        // Unbound however the step ends (an error or a panic), so no later
        // call of the same shape runs through this step's table.
        let _unbind = Unbind(b);
        run_seqs_step(model, b, segs, plan, &mut step)
    };
    let out = ran.and_then(|()| advance_and_read(model, b, segs, &step.h));
    b.put_seqs_step(plan.key, step);
    out
}

/// Calls [`Backend::unbind_seqs`] when dropped.
struct Unbind<'a, B: Backend>(&'a B);

impl<B: Backend> Drop for Unbind<'_, B> {
    fn drop(&mut self) {
        self.0.unbind_seqs();
    }
}

fn run_seqs_step<B: Backend>(
    model: &Model,
    b: &B,
    segs: &mut [Segment<'_, B::State>],
    plan: crate::backend::SeqsStep,
    s: &mut DecodeStep<B>,
) -> Result<()> {
    let mut tokens: Vec<u32> = segs.iter().map(|s| s.tokens[0]).collect();
    tokens.resize(plan.rows, 0);
    b.embed(model, &tokens, &mut s.h)?;
    let mut sts: Vec<&mut B::State> = segs.iter_mut().map(|s| &mut *s.state).collect();
    {
        let view: Vec<&B::State> = sts.iter().map(|s| &**s).collect();
        b.bind_seqs(model, plan, &view)?;
    }
    let rows = vec![1; sts.len()];
    if let Some(g) = &s.graph {
        b.replay_seqs(g)
    } else if s.eager_steps == 0 || s.no_graph {
        layers_seqs(model, b, &mut sts, &rows, &mut s.h, &mut s.x, &mut s.y)?;
        s.eager_steps += 1;
        Ok(())
    } else {
        b.begin_recording_seqs()?;
        let ran = layers_seqs(model, b, &mut sts, &rows, &mut s.h, &mut s.x, &mut s.y);
        // End the recording whatever happened, so the backend runs calls again.
        let recorded = b.end_recording_seqs();
        match ran.and(recorded) {
            Ok(g) => {
                b.replay_seqs(&g)?;
                s.graph = Some(g);
                Ok(())
            }
            Err(err) => {
                eprintln!(
                    "warning: recording a step of {} rows failed ({err}); steps of its size run without recording",
                    plan.rows
                );
                s.no_graph = true;
                layers_seqs(model, b, &mut sts, &rows, &mut s.h, &mut s.x, &mut s.y)
            }
        }
    }
}

/// A backend's logits or greedy picks that do not match the rows asked.
fn logits_mismatch(msg: String) -> EngineError {
    EngineError::Device {
        backend: "engine",
        op: "logits".into(),
        msg,
    }
}

/// A backend's greedy pick that did not give one token a row.
fn picked_count(got: usize, rows: usize) -> EngineError {
    logits_mismatch(format!("the backend picked {got} tokens for {rows} rows"))
}

/// One token of one sequence on a backend that records steps
/// ([`Backend::records_steps`]): the first step runs call by call (loading
/// what the step needs), the second is recorded and replayed, later ones
/// replay the recording. The recording holds the same calls with the same
/// arguments (the backend reads the position from the state at replay), so
/// every step computes the bytes of [`layers_one`] on its row.
/// [`forward_batch`] (its caller) has reserved the row's position.
fn decode_step<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    token: u32,
    want: Logits,
) -> Result<BatchLogits> {
    let d = model.hp.n_embd;
    let mut step = match b.take_step(st) {
        Some(s) => s,
        None => DecodeStep {
            h: b.alloc(d)?,
            x: b.alloc(d)?,
            y: b.alloc(d)?,
            graph: None,
            eager_steps: 0,
            no_graph: false,
        },
    };
    let out = run_decode_step(model, b, st, &mut step, token, want);
    b.put_step(st, step);
    out
}

fn run_decode_step<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    s: &mut DecodeStep<B>,
    token: u32,
    want: Logits,
) -> Result<BatchLogits> {
    b.embed(model, &[token], &mut s.h)?;
    if let Some(g) = &s.graph {
        b.replay(st, g)?;
    } else if s.eager_steps == 0 || s.no_graph {
        layers_one(model, b, st, &mut s.h, &mut s.x, &mut s.y)?;
        s.eager_steps += 1;
    } else {
        b.begin_recording(st)?;
        let ran = layers_one(model, b, st, &mut s.h, &mut s.x, &mut s.y);
        // End the recording whatever happened, so the backend runs calls again.
        let recorded = b.end_recording(st);
        match ran.and(recorded) {
            Ok(g) => {
                b.replay(st, &g)?;
                s.graph = Some(g);
            }
            Err(err) => {
                // Nothing ran while recording: run the step call by call,
                // and keep this sequence's steps so from now on.
                eprintln!(
                    "warning: recording the decode step failed ({err}); this sequence decodes without recorded steps"
                );
                s.no_graph = true;
                layers_one(model, b, st, &mut s.h, &mut s.x, &mut s.y)?;
            }
        }
    }
    b.advance(st, 1);
    let (data, token) = match want {
        Logits::None => (Vec::new(), None),
        Logits::Greedy => match b.logits_argmax(model, &s.h, &[0])?[..] {
            [t] => (Vec::new(), Some(t)),
            ref got => return Err(picked_count(got.len(), 1)),
        },
        _ => (b.logits(model, &s.h, &[0])?, None),
    };
    Ok(BatchLogits {
        ends: vec![data.len()],
        data,
        tokens: vec![token],
    })
}

/// The layer stack over one sequence's rows: `h` (the embedded rows) is
/// updated in place, `x` and `y` are scratch of the same size. This is what
/// [`forward_batch`] runs for a single sequence, and what `decode_step`
/// records. The caller has reserved the rows ([`Backend::reserve`]).
pub fn layers_one<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    h: &mut B::Buf,
    x: &mut B::Buf,
    y: &mut B::Buf,
) -> Result<()> {
    for l in 0..model.w.layers.len() {
        layer(model, b, l, st, h, x, y)?;
    }
    Ok(())
}

/// Layer `l` of [`layers_one`] (layer 0 also runs the first input norm).
fn layer<B: Backend>(
    model: &Model,
    b: &B,
    l: usize,
    st: &mut B::State,
    h: &mut B::Buf,
    x: &mut B::Buf,
    y: &mut B::Buf,
) -> Result<()> {
    let n_layers = model.w.layers.len();
    let lw = &model.w.layers[l];
    if l == 0 {
        b.rms_norm(model, Norm::Attn(l), h, x)?;
    }
    mixer(model, b, l, &lw.mixer, x, st, y)?;
    if l + 1 < n_layers {
        // The post-mixer norm, then the MoE and the residual add fused with
        // the next layer's input norm.
        b.add_rms_norm(model, Norm::Ffn(l), h, y, x)?;
        b.moe_add_rms_norm(model, &lw.moe, Norm::Attn(l + 1), h, x, y)
    } else {
        b.add_rms_norm(model, Norm::Ffn(l), h, y, x)?;
        b.moe(model, &lw.moe, x, y)?;
        b.add(h, y)
    }
}

/// Two consecutive chunks of one sequence (`first` at the state's next
/// positions, `second` right after it) as a wavefront: with a backend of two
/// lanes ([`Backend::lanes`]), `first` runs on lane 0 and `second` on lane
/// 1, and the second's layer `l` waits only for the first's layer `l` (the
/// keys, values and delta-rule state it reads), so the second's early layers
/// run beside the first's later ones. Every op gets the rows and the state
/// it gets from two [`forward`] calls, in the same order per layer, so the
/// logits and the state are the same bytes (the identity gate runs
/// through here). Returns each chunk's logits as `want` asks.
pub fn forward_pair<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    first: &[u32],
    second: &[u32],
    want: [Logits; 2],
) -> Result<[Vec<f32>; 2]> {
    pair_in_order(model, b, st, first, second, want, false)
}

/// [`forward_pair`] with the order broken on purpose: the second chunk's
/// layer `l` issued before the first chunk's, without the wait (so it reads
/// keys, values and delta-rule state the first chunk has not written). The
/// negative control of the pair tests, never a user path.
#[doc(hidden)]
pub fn forward_pair_misordered<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    first: &[u32],
    second: &[u32],
    want: [Logits; 2],
) -> Result<[Vec<f32>; 2]> {
    pair_in_order(model, b, st, first, second, want, true)
}

fn pair_in_order<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    first: &[u32],
    second: &[u32],
    want: [Logits; 2],
    misordered: bool,
) -> Result<[Vec<f32>; 2]> {
    // One-token chunks are decode steps (their own path); empty ones do nothing.
    if b.lanes() < 2 || first.len() < 2 || second.len() < 2 {
        let a = forward(model, b, st, first, want[0])?;
        let c = forward(model, b, st, second, want[1])?;
        return Ok([a, c]);
    }
    let d = model.hp.n_embd;
    let (n0, n1) = (first.len(), second.len());
    let p0 = b.position(st);
    if p0 + n0 + n1 > b.capacity(st) {
        return Err(EngineError::ContextFull {
            pos: p0 + n0 + n1 - 1,
            ctx: b.capacity(st),
        });
    }
    // Both chunks' positions, before either lane runs.
    b.reserve(st, n0 + n1)?;
    let n_layers = model.w.layers.len();
    let mut bufs: Vec<(B::Buf, B::Buf, B::Buf)> = Vec::with_capacity(2);
    let run =
        |st: &mut B::State, bufs: &mut Vec<(B::Buf, B::Buf, B::Buf)>, lane: usize, l: usize| {
            b.enter_lane(st, lane, if lane == 0 { p0 } else { p0 + n0 })?;
            if lane == 1 && !misordered {
                b.lane_wait(0, l)?;
            }
            let (h, x, y) = &mut bufs[lane];
            layer(model, b, l, st, h, x, y)?;
            b.lane_mark(l)
        };
    let result: Result<()> = (|| {
        for (lane, (toks, pos)) in [(first, p0), (second, p0 + n0)].into_iter().enumerate() {
            b.enter_lane(st, lane, pos)?;
            let m = toks.len();
            let mut h = b.alloc(m * d)?;
            b.embed(model, toks, &mut h)?;
            bufs.push((h, b.alloc(m * d)?, b.alloc(m * d)?));
        }
        if misordered {
            for l in 0..n_layers {
                run(st, &mut bufs, 1, l)?;
                run(st, &mut bufs, 0, l)?;
            }
        } else {
            for s in 0..=n_layers {
                if s < n_layers {
                    run(st, &mut bufs, 0, s)?;
                }
                if s > 0 {
                    run(st, &mut bufs, 1, s - 1)?;
                }
            }
        }
        Ok(())
    })();
    // The join: lane 0 waits for everything lane 1 has issued (mark
    // `n_layers`, past the layers' own), also after an error (a bad token,
    // a failed allocation), so the backend is left on lane 0 with nothing
    // of this pair running beside it.
    let join = b
        .enter_lane(st, 1, p0 + n0)
        .and_then(|_| b.lane_mark(n_layers))
        .and_then(|_| b.enter_lane(st, 0, p0))
        .and_then(|_| b.lane_wait(1, n_layers));
    result?;
    join?;
    b.advance(st, n0 + n1);
    let mut out = [Vec::new(), Vec::new()];
    for (i, (n, w)) in [(n0, want[0]), (n1, want[1])].into_iter().enumerate() {
        let rows: Vec<usize> = w.rows(0, n).collect();
        if !rows.is_empty() {
            out[i] = b.logits(model, &bufs[i].0, &rows)?;
        }
    }
    Ok(out)
}

/// A prompt's rows in chunks of `chunk` (the last may be shorter), two at a
/// time through [`forward_pair`]; returns the logits `want` asks of the last
/// chunk (the others ask for none).
pub fn prefill<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    tokens: &[u32],
    chunk: usize,
    want: Logits,
) -> Result<Vec<f32>> {
    let pieces: Vec<&[u32]> = tokens.chunks(chunk.max(1)).collect();
    let n = pieces.len();
    forward_chunks(model, b, st, &pieces, |i| {
        if i + 1 == n { want } else { Logits::None }
    })
}

/// Consecutive chunks of one sequence, two at a time through
/// [`forward_pair`] (an odd last one through [`forward`]); chunk `i` returns
/// the logits `want(i)` asks for, and they come back concatenated in order.
pub fn forward_chunks<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    pieces: &[&[u32]],
    want: impl Fn(usize) -> Logits,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for (p, pair) in pieces.chunks(2).enumerate() {
        match *pair {
            [c0, c1] => {
                let [l0, l1] = forward_pair(model, b, st, c0, c1, [want(2 * p), want(2 * p + 1)])?;
                out.extend(l0);
                out.extend(l1);
            }
            [c] => out.extend(forward(model, b, st, c, want(2 * p))?),
            _ => {}
        }
    }
    Ok(out)
}

fn mixer<B: Backend>(
    model: &Model,
    b: &B,
    l: usize,
    mixer: &Mixer,
    x: &B::Buf,
    st: &mut B::State,
    y: &mut B::Buf,
) -> Result<()> {
    match mixer {
        Mixer::Attention(a) => b.attention(model, l, a, x, st, y),
        Mixer::Linear(dn) => b.delta_net(model, l, dn, x, st, y),
    }
}
