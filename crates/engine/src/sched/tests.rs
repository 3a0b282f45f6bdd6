//! The scheduler driven directly on the CPU: requests batched together
//! (mixed prompt lengths, late joiners, a full batch, a restore from the
//! prefix cache) each get the tokens and log-probabilities they get alone;
//! the KV budget holds a request back until memory is free and refuses one
//! that could never fit; cancel and finish give their reservation back.

use super::*;
use crate::Result;
use crate::backend::Norm;
use crate::cpu::Cpu;
use crate::model::weights::{AttentionW, DeltaNetW, MoeW};
use crate::state::SeqState;
use samesum_gguf::GgmlType;
use samesum_synth::{SynthOptions, shapes, write_model};

fn model(shape: &str) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_model(
        &SynthOptions::new(shapes::by_name(shape).unwrap(), GgmlType::Q8_0, 7),
        &p,
        &mut |_, _| {},
    )
    .unwrap();
    let m = Model::load(&p).unwrap();
    (dir, m)
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt) % 200 + 3).collect()
}

fn request(prompt: Vec<u32>, max_new: usize, seeded: bool) -> Request {
    Request {
        prompt,
        max_new,
        sampler: if seeded {
            SamplerConfig {
                temp: 0.9,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 99,
                ..Default::default()
            }
        } else {
            SamplerConfig {
                temp: 0.0,
                ..Default::default()
            }
        },
        penalties: Penalties::default(),
        logit_bias: Vec::new(),
        stop_tokens: Vec::new(),
        logprobs: Some(3),
        constraint: None,
    }
}

fn config(max_batch: usize, cache: u64, budget: Option<u64>) -> Config {
    Config {
        max_batch,
        prefill_chunk: 16,
        kv: KvType::F32,
        prefix_cache_bytes: cache,
        kv_budget: budget,
    }
}

/// A request's tokens, log-probabilities and alternatives as bits, and its
/// finish reason: the bytes batching must not change.
type Bytes = (Vec<(u32, u32, Vec<(u32, u32)>)>, Option<Finish>);

fn record(out: &[Output], id: SeqId, into: &mut Bytes) {
    for o in out {
        match o {
            Output::Token {
                id: i,
                token,
                logprob,
            } if *i == id => {
                let l = logprob.as_ref().expect("log-probabilities asked for");
                let top = l.top.iter().map(|&(t, p)| (t, p.to_bits())).collect();
                into.0.push((*token, l.logprob.to_bits(), top));
            }
            Output::Finished { id: i, finish, .. } if *i == id => into.1 = Some(*finish),
            Output::Failed { id: i, error } if *i == id => panic!("request failed: {error}"),
            _ => {}
        }
    }
}

fn alone<B: Backend>(model: &Model, b: &B, req: &Request) -> Bytes {
    let mut s = Scheduler::new(model, b, config(1, 0, None));
    let id = s.submit(req.clone()).unwrap();
    let mut got = Bytes::default();
    while !s.is_idle() {
        record(&s.step(), id, &mut got);
    }
    assert_eq!(got.1, Some(Finish::Length));
    got
}

/// Five requests of mixed prompt lengths (one crossing a KV block, one of a
/// single token), greedy and seeded, three at the start and two joining
/// later through a batch of four (filled at one step); the last one
/// extends the first's prompt and starts from its saved state. Each gets
/// the bytes it gets alone.
#[test]
fn batched_requests_get_the_bytes_they_get_alone() {
    for shape in ["tiny-qwen3moe", "tiny-qwen35moe"] {
        let (_dir, m) = model(shape);
        let b = Cpu::new(2);
        let p0 = tokens(40, 1);
        let reqs = [
            request(p0.clone(), 10, false),
            request(tokens(300, 2), 4, true),
            request(tokens(1, 3), 12, true),
            request(tokens(70, 4), 3, false),
            request([p0.clone(), tokens(9, 5)].concat(), 5, true),
        ];
        let want: Vec<Bytes> = reqs.iter().map(|r| alone(&m, &b, r)).collect();
        let mut s = Scheduler::new(&m, &b, config(4, 64 << 20, None));
        let mut ids = Vec::new();
        let mut got = vec![Bytes::default(); reqs.len()];
        let mut steps = 0;
        while ids.len() < reqs.len() || !s.is_idle() {
            // Two join late: one after the first's prompt is saved.
            let due = match steps {
                0 => 3,
                1 => 4,
                9 => 5,
                _ => ids.len(),
            };
            while ids.len() < due {
                ids.push(s.submit(reqs[ids.len()].clone()).unwrap());
            }
            let out = s.step();
            for (k, &id) in ids.iter().enumerate() {
                record(&out, id, &mut got[k]);
            }
            steps += 1;
            assert!(steps < 1000, "{shape}: the scheduler made no progress");
        }
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{shape}: request {k} changed in a batch");
        }
        let st = s.stats();
        assert_eq!(st.max_step_seqs, 4, "{shape}: the batch was never full");
        assert!(
            st.prefix_hits >= 1,
            "{shape}: the follow-up was not restored"
        );
        assert_eq!((st.running, st.waiting, st.kv_reserved), (0, 0, 0));
    }
}

/// The 64 requests of the test below: prompts of 1 to 150 tokens, 20 to 28
/// generated, every other one seeded.
fn sixty_four() -> Vec<Request> {
    (0..64)
        .map(|k| request(tokens(1 + (k * 37) % 150, k as u32), 20 + k % 9, k % 2 == 1))
        .collect()
}

/// `reqs` through one scheduler of 64 slots: 48 submitted at once, the
/// rest joining one a step from the third step on. Each one's bytes, and
/// the most requests a step carried.
fn batched<B: Backend>(model: &Model, b: &B, reqs: &[Request]) -> (Vec<Bytes>, usize) {
    let cfg = Config {
        prefill_chunk: 256,
        ..config(64, 0, None)
    };
    let mut s = Scheduler::new(model, b, cfg);
    let (mut ids, mut got, mut steps) = (Vec::new(), vec![Bytes::default(); reqs.len()], 0);
    while ids.len() < reqs.len() || !s.is_idle() {
        let due = if steps == 0 {
            48
        } else if steps >= 3 {
            ids.len() + 1
        } else {
            ids.len()
        };
        while ids.len() < due.min(reqs.len()) {
            ids.push(s.submit(reqs[ids.len()].clone()).unwrap());
        }
        let out = s.step();
        for (k, &id) in ids.iter().enumerate() {
            record(&out, id, &mut got[k]);
        }
        steps += 1;
        assert!(steps < 5000, "the scheduler made no progress");
    }
    assert_eq!(s.stats().kv_reserved, 0);
    (got, s.stats().max_step_seqs)
}

/// Batch invariance at scale: 64 requests of mixed prompt lengths, greedy
/// and seeded, 16 of them joining late, each get the bytes (tokens,
/// log-probabilities, alternatives) they get alone, on an attention model
/// and a hybrid one. The negative control: a backend whose MoE output
/// depends on the rows in the call gives other bytes batched than alone.
#[test]
fn sixty_four_requests_get_the_bytes_they_get_alone() {
    for shape in ["tiny-qwen3moe", "tiny-qwen35moe"] {
        let (_dir, m) = model(shape);
        let cpu = Cpu::new(2);
        let reqs = sixty_four();
        let want: Vec<Bytes> = reqs.iter().map(|r| alone(&m, &cpu, r)).collect();
        let (got, most) = batched(&m, &cpu, &reqs);
        assert!(most >= 40, "{shape}: at most {most} requests shared a step");
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{shape}: request {k} changed in a batch of 64");
        }
        // The control: a batch-variant backend is caught.
        let bad = Faulty::batch_variant(&cpu);
        let want: Vec<Bytes> = reqs.iter().map(|r| alone(&m, &bad, r)).collect();
        let (got, _) = batched(&m, &bad, &reqs);
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        assert!(differ > 0, "{shape}: a batch-variant MoE went unnoticed");
    }
}

/// With room for one request's context only, the second waits until the
/// first has finished (its Started comes after the first's Finished), is
/// counted as waiting for memory, and both get the bytes they get alone; a
/// third, waiting, is cancelled and never starts.
#[test]
fn a_request_waits_for_memory_and_is_unchanged() {
    let (_dir, m) = model("tiny-qwen35moe");
    let b = Cpu::new(2);
    let r1 = request(tokens(20, 1), 6, true);
    let r2 = request(tokens(30, 2), 6, false);
    let probe = Scheduler::new(&m, &b, config(4, 0, None));
    let (n1, n2) = (probe.request_bytes(20, 6), probe.request_bytes(30, 6));
    assert!(n1 > 0 && n2 > 0);
    let budget = n1.max(n2) + n1.min(n2) / 2;
    let mut s = Scheduler::new(&m, &b, config(4, 0, Some(budget)));
    let id1 = s.submit(r1.clone()).unwrap();
    let id2 = s.submit(r2.clone()).unwrap();
    let id3 = s.submit(request(tokens(5, 3), 2, false)).unwrap();
    let mut all = Vec::new();
    let first = s.step();
    let st = s.stats();
    assert_eq!((st.running, st.waiting, st.waiting_for_memory), (1, 2, 2));
    assert_eq!(
        (st.memory_waits, st.kv_reserved, st.kv_budget),
        (1, n1, Some(budget))
    );
    all.extend(first);
    assert!(s.cancel(id3));
    assert!(!s.cancel(id3));
    while !s.is_idle() {
        all.extend(s.step());
    }
    let at = |f: &dyn Fn(&Output) -> bool| all.iter().position(f).unwrap();
    let done1 = at(&|o| matches!(o, Output::Finished { id, .. } if *id == id1));
    let start2 = at(&|o| matches!(o, Output::Started { id, .. } if *id == id2));
    assert!(
        start2 > done1,
        "the second started before the first finished"
    );
    assert!(
        !all.iter()
            .any(|o| matches!(o, Output::Started { id, .. } if *id == id3))
    );
    let (mut g1, mut g2) = (Bytes::default(), Bytes::default());
    record(&all, id1, &mut g1);
    record(&all, id2, &mut g2);
    assert_eq!(g1, alone(&m, &b, &r1));
    assert_eq!(g2, alone(&m, &b, &r2));
    let st = s.stats();
    assert_eq!(
        (st.memory_waits, st.kv_reserved, st.waiting_for_memory),
        (1, 0, 0)
    );
}

/// A request larger than the whole budget is refused at once, with the
/// bytes it needs and the budget in the message; one that fits exactly is
/// taken. Bad requests are refused too.
#[test]
fn a_request_over_the_whole_budget_is_refused() {
    let (_dir, m) = model("tiny-qwen3next");
    let b = Cpu::new(1);
    let probe = Scheduler::new(&m, &b, config(2, 0, None));
    let need = probe.request_bytes(10, 300);
    // 311 tokens: two KV blocks.
    assert_eq!(
        need,
        2 * KV_BLOCK as u64 * crate::state::kv_bytes_per_token(&m.hp, KvType::F32)
            + crate::state::recurrent_bytes(&m.hp)
    );
    let mut s = Scheduler::new(&m, &b, config(2, 0, Some(need - 1)));
    let e = s.submit(request(tokens(10, 1), 300, false)).unwrap_err();
    assert_eq!(
        e,
        SubmitError::OverBudget {
            need,
            ctx: 311,
            budget: need - 1
        }
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&need.to_string()) && msg.contains("whole KV budget"),
        "{msg}"
    );
    assert!(s.is_idle());
    let mut s = Scheduler::new(&m, &b, config(2, 0, Some(need)));
    assert!(s.submit(request(tokens(10, 1), 300, false)).is_ok());
    assert_eq!(
        s.submit(request(Vec::new(), 3, false)),
        Err(SubmitError::EmptyPrompt)
    );
    assert_eq!(
        s.submit(request(tokens(3, 1), 0, false)),
        Err(SubmitError::NoTokens)
    );
    let vocab = m.w.n_vocab;
    assert!(matches!(
        s.submit(request(vec![vocab as u32], 3, false)),
        Err(SubmitError::BadToken { .. })
    ));
}

/// `finish` ends a running request with its counts and saves its state
/// (the prompt and the tokens fed) in the prefix cache; a stop token ends
/// one without reporting the token.
#[test]
fn finish_saves_the_state_and_a_stop_token_ends_the_request() {
    let (_dir, m) = model("tiny-qwen3moe");
    let b = Cpu::new(1);
    let r = request(tokens(12, 1), 8, false);
    let first = alone(&m, &b, &r).0[0].0;
    let mut s = Scheduler::new(&m, &b, config(2, 64 << 20, Some(1 << 30)));
    let id = s.submit(r.clone()).unwrap();
    let mut got = Bytes::default();
    while got.0.len() < 2 {
        record(&s.step(), id, &mut got);
    }
    let entries = s.stats().prefix_entries;
    let info = s.finish(id).unwrap();
    assert_eq!(
        (info.prompt_tokens, info.cached_tokens, info.generated),
        (12, 0, 2)
    );
    assert!(info.prefilled.is_some());
    let st = s.stats();
    assert_eq!((st.prefix_entries, st.kv_reserved), (entries + 1, 0));
    assert!(s.finish(id).is_none() && s.is_idle());
    // The first token as a stop token: no token, finish `stop`.
    let id = s
        .submit(Request {
            stop_tokens: vec![first],
            ..r
        })
        .unwrap();
    let mut got = Bytes::default();
    while !s.is_idle() {
        record(&s.step(), id, &mut got);
    }
    assert_eq!(got, (Vec::new(), Some(Finish::Stop)));
}

#[test]
fn prefill_goes_to_the_shortest_prompt_unless_one_waited_too_long() {
    // Shortest remaining first, ties in arrival order.
    assert_eq!(
        prefill_order(&[(6000, 0), (5, 0), (40, 0), (5, 0)]),
        [1, 3, 2, 0]
    );
    // Passed over AGING_STEPS times: first, however long.
    assert_eq!(prefill_order(&[(6000, AGING_STEPS), (5, 0)]), [0, 1]);
    assert_eq!(prefill_order(&[(6000, AGING_STEPS - 1), (5, 0)]), [1, 0]);
    // Among the aged, the longest waiting first.
    assert_eq!(
        prefill_order(&[(10, AGING_STEPS), (20, AGING_STEPS + 3), (1, 0)]),
        [1, 0, 2]
    );
}

#[test]
fn logprobs_are_a_log_softmax_with_the_top_in_order() {
    let l = logprob(&[0.0, 2.0, 2.0, -1.0], 3, 3);
    let lse = (1.0f64 + 2.0 * 2f64.exp() + (-1f64).exp()).ln();
    assert_eq!(l.logprob, (-1.0 - lse) as f32);
    let ids: Vec<u32> = l.top.iter().map(|&(t, _)| t).collect();
    assert_eq!(ids, [1, 2, 0]);
    assert!(logprob(&[1.0], 0, 0).top.is_empty());
}

/// A constraint that forces a token sequence, then allows only the end.
struct Script {
    want: Vec<u32>,
    at: usize,
}

impl crate::constraint::Constraint for Script {
    fn mask(&mut self, allowed: &mut [bool]) -> Result<bool, String> {
        for (t, a) in allowed.iter_mut().enumerate() {
            *a = self.want.get(self.at) == Some(&(t as u32));
        }
        Ok(self.at == self.want.len())
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.want.get(self.at) != Some(&token) {
            return Err(format!("token {token} not allowed"));
        }
        self.at += 1;
        Ok(())
    }
    fn stopped(&self) -> bool {
        false
    }
}

/// A constrained request samples only what its constraint allows and ends
/// (`stop`) when the constraint is complete and only a stop token is
/// allowed; its log-probabilities are the model's, the same bits as the
/// unconstrained request's where both sampled the same tokens so far; and
/// it gets the same bytes in a batch with other requests as alone.
#[test]
fn a_constraint_decides_the_tokens_and_nothing_else() {
    let (_dir, m) = model("tiny-qwen3moe");
    let b = Cpu::new(2);
    let prompt = tokens(9, 4);
    let free = alone(&m, &b, &request(prompt.clone(), 6, false));
    // Force the unconstrained run's first two tokens, then two others.
    let forced = vec![free.0[0].0, free.0[1].0, 17, 23];
    let constrained = || Request {
        stop_tokens: vec![5],
        constraint: Some(crate::constraint::SharedConstraint::new(Script {
            want: forced.clone(),
            at: 0,
        })),
        ..request(prompt.clone(), 6, false)
    };
    let run = |others: usize| {
        let mut s = Scheduler::new(&m, &b, config(4, 0, None));
        for k in 0..others {
            s.submit(request(tokens(5 + k, 9), 6, true)).unwrap();
        }
        let id = s.submit(constrained()).unwrap();
        let mut got = Bytes::default();
        while !s.is_idle() {
            record(&s.step(), id, &mut got);
        }
        got
    };
    let solo = run(0);
    let toks: Vec<u32> = solo.0.iter().map(|x| x.0).collect();
    assert_eq!(toks, forced);
    assert_eq!(solo.1, Some(Finish::Stop));
    // The model's log-probabilities: equal where the histories are equal.
    assert_eq!(solo.0[..2], free.0[..2]);
    assert_eq!(run(3), solo);
}

/// Greedy requests without log-probabilities, a bias or penalties take the
/// step's greedy pick (`Logits::Greedy`, no logits on the host); their
/// tokens equal those of the same requests sampled from the logits (a zero
/// bias, which changes nothing but takes the sampler's path), batched four
/// together; and the greedy pick of `forward_batch` is the argmax of the
/// logits it would return.
#[test]
fn greedy_picks_equal_sampling_from_the_logits() {
    let (_d, model) = model("tiny-qwen3next");
    let cpu = Cpu::new(2);
    let tokens_of = |bias: Vec<(u32, f32)>| -> (Vec<Vec<u32>>, u64) {
        let mut s = Scheduler::new(&model, &cpu, config(4, 0, None));
        let ids: Vec<SeqId> = (0..4)
            .map(|k| {
                let mut r = request(tokens(5 + 9 * k, k as u32), 12, false);
                r.logprobs = None;
                r.logit_bias = bias.clone();
                s.submit(r).unwrap()
            })
            .collect();
        let mut got = vec![Vec::new(); 4];
        while !s.is_idle() {
            for o in s.step() {
                if let Output::Token { id, token, .. } = o {
                    got[ids.iter().position(|&i| i == id).unwrap()].push(token);
                }
            }
        }
        (got, s.stats().greedy_picks)
    };
    let (picked, n_picked) = tokens_of(Vec::new());
    let (sampled, n_sampled) = tokens_of(vec![(0, 0.0)]);
    assert!(picked.iter().all(|t| t.len() == 12));
    assert_eq!(picked, sampled);
    assert_eq!(
        (n_picked, n_sampled),
        (48, 0),
        "every plain greedy token picked by the step"
    );

    let toks = tokens(7, 3);
    let mut a = cpu.new_state(&model, 16, KvType::F32).unwrap();
    let mut b = cpu.new_state(&model, 16, KvType::F32).unwrap();
    let mut segs = [
        Segment {
            state: &mut a,
            tokens: &toks,
            want: Logits::Greedy,
        },
        Segment {
            state: &mut b,
            tokens: &toks,
            want: Logits::Last,
        },
    ];
    let out = forward_batch(&model, &cpu, &mut segs).unwrap();
    assert!(out[0].is_empty());
    assert_eq!(out.token(1), None);
    assert_eq!(out.token(0), Some(crate::sample::argmax(&out[1])));
}

/// The steps' time splits into forward time (by rows) and host time: both
/// counted, neither twice (together within the wall time of the steps).
#[test]
fn step_time_splits_into_forward_and_host() {
    let (_d, model) = model("tiny-qwen3moe");
    let cpu = Cpu::new(2);
    let mut s = Scheduler::new(&model, &cpu, config(4, 0, None));
    for k in 0..4 {
        s.submit(request(tokens(5 + 9 * k, k as u32), 8, false))
            .unwrap();
    }
    let t = std::time::Instant::now();
    while !s.is_idle() {
        s.step();
    }
    let wall = t.elapsed().as_secs_f64();
    let st = s.stats();
    let forward = st.prefill_seconds + st.decode_seconds;
    assert!(forward > 0.0 && st.host_seconds > 0.0, "{st:?}");
    assert!(
        forward + st.host_seconds <= wall + 1e-6,
        "{forward} + {} > {wall}",
        st.host_seconds
    );
}

/// The CPU backend with a fault: [`Backend::reserve`] fails the first
/// `fails` calls for a state at position 0 taking `rows` rows (a request's
/// first prompt chunk: a device without memory for one request's KV
/// blocks); with `batch_variant`, the MoE's output depends on how many rows
/// share the call (a kernel that breaks the row contract).
struct Faulty<'a> {
    cpu: &'a Cpu,
    rows: usize,
    fails: std::sync::atomic::AtomicUsize,
    batch_variant: bool,
}

impl<'a> Faulty<'a> {
    fn no_memory_for(cpu: &'a Cpu, rows: usize) -> Self {
        Faulty {
            cpu,
            rows,
            fails: 1.into(),
            batch_variant: false,
        }
    }
    fn batch_variant(cpu: &'a Cpu) -> Self {
        Faulty {
            cpu,
            rows: 0,
            fails: 0.into(),
            batch_variant: true,
        }
    }
}

impl Backend for Faulty<'_> {
    type Buf = Vec<f32>;
    type Graph = ();
    type State = SeqState;

    fn name(&self) -> String {
        self.cpu.name()
    }
    fn alloc(&self, n: usize) -> Result<Vec<f32>> {
        self.cpu.alloc(n)
    }
    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        self.cpu.upload(host)
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        self.cpu.download(buf)
    }
    fn new_state(&self, model: &Model, ctx: usize, kv: KvType) -> Result<SeqState> {
        self.cpu.new_state(model, ctx, kv)
    }
    fn position(&self, st: &SeqState) -> usize {
        self.cpu.position(st)
    }
    fn capacity(&self, st: &SeqState) -> usize {
        self.cpu.capacity(st)
    }
    fn download_state(&self, st: &SeqState) -> Result<Vec<f32>> {
        self.cpu.download_state(st)
    }
    fn reserve(&self, st: &mut SeqState, m: usize) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if st.pos == 0 && m == self.rows && self.fails.load(Relaxed) > 0 {
            self.fails.fetch_sub(1, Relaxed);
            return Err(crate::EngineError::Alloc {
                what: "KV cache",
                ctx: st.ctx,
                bytes: 1 << 40,
            });
        }
        self.cpu.reserve(st, m)
    }
    fn advance(&self, st: &mut SeqState, m: usize) {
        self.cpu.advance(st, m)
    }
    fn fork_state(&self, st: &SeqState, ctx: usize) -> Result<SeqState> {
        self.cpu.fork_state(st, ctx)
    }
    fn rows(&self, x: &Vec<f32>, width: usize, r0: usize, n: usize) -> Result<Vec<f32>> {
        self.cpu.rows(x, width, r0, n)
    }
    fn set_rows(&self, dst: &mut Vec<f32>, width: usize, r0: usize, src: &Vec<f32>) -> Result<()> {
        self.cpu.set_rows(dst, width, r0, src)
    }
    fn embed(&self, model: &Model, tokens: &[u32], out: &mut Vec<f32>) -> Result<()> {
        self.cpu.embed(model, tokens, out)
    }
    fn rms_norm(&self, model: &Model, which: Norm, x: &Vec<f32>, out: &mut Vec<f32>) -> Result<()> {
        self.cpu.rms_norm(model, which, x, out)
    }
    fn add(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        self.cpu.add(acc, x)
    }
    fn attention(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &Vec<f32>,
        st: &mut SeqState,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        self.cpu.attention(model, l, a, x, st, y)
    }
    fn delta_net(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &Vec<f32>,
        st: &mut SeqState,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        self.cpu.delta_net(model, l, dn, x, st, y)
    }
    fn moe(&self, model: &Model, mw: &MoeW, x: &Vec<f32>, y: &mut Vec<f32>) -> Result<()> {
        self.cpu.moe(model, mw, x, y)?;
        if self.batch_variant {
            // Each row's first value moved by an amount that grows with
            // the rows in the call: alone (one row) it stays as it was.
            let width = model.hp.n_embd;
            let rows = y.len() / width;
            for r in 0..rows {
                y[r * width] += 1e-3 * (rows - 1) as f32;
            }
        }
        Ok(())
    }
    fn logits(&self, model: &Model, h: &Vec<f32>, rows: &[usize]) -> Result<Vec<f32>> {
        self.cpu.logits(model, h, rows)
    }
}

/// Run `reqs` together on `b` (all submitted at once), returning each
/// one's bytes, or None where it failed, with the failure's text.
fn run_all<B: Backend>(
    model: &Model,
    b: &B,
    cache: u64,
    reqs: &[Request],
) -> (Vec<Option<Bytes>>, Vec<String>, Stats) {
    let mut s = Scheduler::new(model, b, config(4, cache, None));
    let ids: Vec<SeqId> = reqs.iter().map(|r| s.submit(r.clone()).unwrap()).collect();
    let mut got = vec![Some(Bytes::default()); reqs.len()];
    let mut errors = Vec::new();
    let mut steps = 0;
    while !s.is_idle() {
        for o in s.step() {
            for (k, &id) in ids.iter().enumerate() {
                match &o {
                    Output::Failed { id: i, error } if *i == id => {
                        got[k] = None;
                        errors.push(error.clone());
                    }
                    _ => {
                        if let Some(g) = got[k].as_mut() {
                            record(std::slice::from_ref(&o), id, g);
                        }
                    }
                }
            }
        }
        steps += 1;
        assert!(steps < 1000, "the scheduler made no progress");
    }
    (got, errors, s.stats())
}

/// A request whose KV blocks the device cannot give fails alone: the
/// requests beside it in the same steps get the bytes they get alone and
/// its reservation is given back. With a prefix cache to empty, the cache
/// gives its memory and nothing fails.
#[test]
fn a_request_without_memory_for_its_cache_fails_alone() {
    let (_d, model) = model("tiny-qwen35moe");
    let cpu = Cpu::new(2);
    let reqs = [
        request(tokens(40, 1), 6, false),
        request(tokens(5, 2), 6, true),
        request(tokens(23, 3), 6, false),
    ];
    let want: Vec<Bytes> = reqs.iter().map(|r| alone(&model, &cpu, r)).collect();
    let b = Faulty::no_memory_for(&cpu, 5);
    let (got, errors, st) = run_all(&model, &b, 0, &reqs);
    assert_eq!(got[0].as_ref(), Some(&want[0]));
    assert_eq!(got[1], None, "the request without memory did not fail");
    assert_eq!(got[2].as_ref(), Some(&want[2]));
    assert_eq!(errors.len(), 1);
    assert!(errors[0].contains("no memory"), "{}", errors[0]);
    assert_eq!((st.running, st.kv_reserved), (0, 0));
    // The control: without the failure, all three get their bytes.
    let (got, errors, _) = run_all(&model, &cpu, 0, &reqs);
    assert!(errors.is_empty());
    assert_eq!(got, want.iter().cloned().map(Some).collect::<Vec<_>>());

    // With a saved state in the prefix cache, the cache is emptied and the
    // reservation tried again: every request gets its bytes.
    let b = Faulty::no_memory_for(&cpu, 5);
    let mut s = Scheduler::new(&model, &b, config(4, 64 << 20, None));
    let first = s.submit(reqs[0].clone()).unwrap();
    let mut g0 = Bytes::default();
    while !s.is_idle() {
        record(&s.step(), first, &mut g0);
    }
    assert_eq!(g0, want[0]);
    assert!(s.stats().prefix_entries > 0, "nothing was saved to empty");
    let id = s.submit(reqs[1].clone()).unwrap();
    let mut g1 = Bytes::default();
    while !s.is_idle() {
        record(&s.step(), id, &mut g1);
    }
    assert_eq!(g1, want[1]);
    assert_eq!(
        s.stats().prefix_cleared,
        1,
        "the cache was not emptied once"
    );
}
