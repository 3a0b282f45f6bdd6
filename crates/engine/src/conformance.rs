//! Conformance bodies written once against [`Backend`], run by every backend's
//! tests (the CPU's in `tests/`, the CUDA backend's on the GPU machine).

use crate::backend::{Backend, Norm};
use crate::forward::{Logits, forward};
use crate::model::Model;
use crate::model::weights::Mixer;
use crate::state::KvType;

/// Where two runs first differ.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// Token position.
    pub position: usize,
    /// Largest |a - b| at that position.
    pub max_abs_diff: f32,
}

/// Run `tokens` twice on fresh states: once in chunks of `chunk` rows, once one
/// token per call (replay), both asking for every position's logits, and compare
/// the bytes. `Ok` means identical at every position.
pub fn forward_rows_match<B: Backend>(
    b: &B,
    model: &Model,
    tokens: &[u32],
    chunk: usize,
) -> Result<(), Divergence> {
    let v = model.w.n_vocab;
    let ctx = tokens.len().max(1);
    let mut st = b.new_state(model, ctx, KvType::F32).expect("state");
    let pieces: Vec<&[u32]> = tokens.chunks(chunk.max(1)).collect();
    let batched = crate::forward::forward_chunks(model, b, &mut st, &pieces, |_| Logits::All)
        .expect("forward");
    let mut st = b.new_state(model, ctx, KvType::F32).expect("state");
    for (p, &t) in tokens.iter().enumerate() {
        let one = forward(model, b, &mut st, &[t], Logits::All).expect("forward");
        let row = &batched[p * v..(p + 1) * v];
        if one.iter().zip(row).any(|(x, y)| x.to_bits() != y.to_bits()) {
            let max_abs_diff = one
                .iter()
                .zip(row)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            return Err(Divergence {
                position: p,
                max_abs_diff,
            });
        }
    }
    Ok(())
}

/// Check every block op of `model` (embedding, both norms of every layer, every
/// layer's mixer with its state, every MoE, the final norm and head): for each
/// `m` in `ms`, one m-row call equals m one-row calls byte for byte (the mixers
/// carrying their state from row to row), on fresh random inputs drawn from
/// `seed`, with every output buffer poisoned with NaN before the call.
pub fn block_ops_match<B: Backend>(
    b: &B,
    model: &Model,
    ms: &[usize],
    seed: u64,
) -> Result<(), String> {
    let d = model.hp.n_embd;
    let mut rng = samesum_quant::rng::Rng::new(seed);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let e = |e: crate::EngineError| e.to_string();
    let nan = |n: usize| b.upload(&vec![f32::NAN; n]).map_err(e);
    let ctx = ms.iter().copied().max().unwrap_or(1);
    let check = |what: String, all: &[f32], rows: &[Vec<f32>]| -> Result<(), String> {
        let w = all.len() / rows.len().max(1);
        for (r, one) in rows.iter().enumerate() {
            if bits(one) != bits(&all[r * w..(r + 1) * w]) {
                return Err(format!(
                    "{what}: row {r} of {} differs from its one-row call",
                    rows.len()
                ));
            }
            if one.iter().any(|v| v.is_nan()) {
                return Err(format!("{what}: row {r} left unwritten (NaN)"));
            }
        }
        Ok(())
    };
    for &m in ms {
        let x: Vec<f32> = (0..m * d).map(|_| rng.range(-2.0, 2.0)).collect();
        let xb = b.upload(&x).map_err(e)?;
        let row = |r: usize| b.upload(&x[r * d..(r + 1) * d]).map_err(e);
        // Embedding.
        let toks: Vec<u32> = (0..m)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        let mut all = nan(m * d)?;
        b.embed(model, &toks, &mut all).map_err(e)?;
        let ones = toks
            .iter()
            .map(|&t| {
                let mut o = nan(d)?;
                b.embed(model, &[t], &mut o).map_err(e)?;
                b.download(&o).map_err(e)
            })
            .collect::<Result<Vec<_>, String>>()?;
        check(format!("embed m={m}"), &b.download(&all).map_err(e)?, &ones)?;
        for (l, lw) in model.w.layers.iter().enumerate() {
            for norm in [Norm::Attn(l), Norm::Ffn(l)] {
                let mut all = nan(m * d)?;
                b.rms_norm(model, norm, &xb, &mut all).map_err(e)?;
                let ones = (0..m)
                    .map(|r| {
                        let mut o = nan(d)?;
                        b.rms_norm(model, norm, &row(r)?, &mut o).map_err(e)?;
                        b.download(&o).map_err(e)
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                check(
                    format!("{norm:?} m={m}"),
                    &b.download(&all).map_err(e)?,
                    &ones,
                )?;
            }
            // The residual add fused with a norm: row-invariant, and
            // byte-equal to `add` then `rms_norm`.
            {
                let inc: Vec<f32> = (0..m * d).map(|_| rng.range(-2.0, 2.0)).collect();
                let incb = b.upload(&inc).map_err(e)?;
                let mut acc = b.upload(&x).map_err(e)?;
                let mut all = nan(m * d)?;
                b.add_rms_norm(model, Norm::Attn(l), &mut acc, &incb, &mut all)
                    .map_err(e)?;
                let (all, acc) = (b.download(&all).map_err(e)?, b.download(&acc).map_err(e)?);
                let mut ones = Vec::with_capacity(m);
                let mut accs = Vec::with_capacity(m);
                for r in 0..m {
                    let mut a1 = row(r)?;
                    let i1 = b.upload(&inc[r * d..(r + 1) * d]).map_err(e)?;
                    let mut o = nan(d)?;
                    b.add_rms_norm(model, Norm::Attn(l), &mut a1, &i1, &mut o)
                        .map_err(e)?;
                    ones.push(b.download(&o).map_err(e)?);
                    accs.push(b.download(&a1).map_err(e)?);
                }
                check(format!("add_rms_norm m={m}"), &all, &ones)?;
                check(format!("add_rms_norm sum m={m}"), &acc, &accs)?;
                let mut acc2 = b.upload(&x).map_err(e)?;
                let mut sep = nan(m * d)?;
                b.add(&mut acc2, &incb).map_err(e)?;
                b.rms_norm(model, Norm::Attn(l), &acc2, &mut sep)
                    .map_err(e)?;
                if bits(&b.download(&sep).map_err(e)?) != bits(&all)
                    || bits(&b.download(&acc2).map_err(e)?) != bits(&acc)
                {
                    return Err(format!(
                        "add_rms_norm m={m}: differs from add then rms_norm"
                    ));
                }
            }
            // The mixer, with its state.
            let mut st_all = b.new_state(model, ctx, KvType::F32).map_err(e)?;
            let mut all = nan(m * d)?;
            let mut st_one = b.new_state(model, ctx, KvType::F32).map_err(e)?;
            let mut ones = Vec::with_capacity(m);
            match &lw.mixer {
                Mixer::Attention(a) => {
                    b.attention(model, l, a, &xb, &mut st_all, &mut all)
                        .map_err(e)?;
                    for r in 0..m {
                        let mut o = nan(d)?;
                        b.attention(model, l, a, &row(r)?, &mut st_one, &mut o)
                            .map_err(e)?;
                        b.advance(&mut st_one, 1);
                        ones.push(b.download(&o).map_err(e)?);
                    }
                }
                Mixer::Linear(dn) => {
                    b.delta_net(model, l, dn, &xb, &mut st_all, &mut all)
                        .map_err(e)?;
                    for r in 0..m {
                        let mut o = nan(d)?;
                        b.delta_net(model, l, dn, &row(r)?, &mut st_one, &mut o)
                            .map_err(e)?;
                        b.advance(&mut st_one, 1);
                        ones.push(b.download(&o).map_err(e)?);
                    }
                }
            }
            check(
                format!("layer {l} mixer m={m}"),
                &b.download(&all).map_err(e)?,
                &ones,
            )?;
            // The MoE.
            let mut all = nan(m * d)?;
            b.moe(model, &lw.moe, &xb, &mut all).map_err(e)?;
            let ones = (0..m)
                .map(|r| {
                    let mut o = nan(d)?;
                    b.moe(model, &lw.moe, &row(r)?, &mut o).map_err(e)?;
                    b.download(&o).map_err(e)
                })
                .collect::<Result<Vec<_>, String>>()?;
            check(
                format!("layer {l} moe m={m}"),
                &b.download(&all).map_err(e)?,
                &ones,
            )?;
        }
        // Final norm and head.
        let rows: Vec<usize> = (0..m).collect();
        let all = b.logits(model, &xb, &rows).map_err(e)?;
        let ones = (0..m)
            .map(|r| b.logits(model, &row(r)?, &[0]).map_err(e))
            .collect::<Result<Vec<_>, String>>()?;
        check(format!("logits m={m}"), &all, &ones)?;
    }
    Ok(())
}

/// The prompts of a Hugging Face fixture's manifest (`"prompts": [[ids], ...]`;
/// a small hand parser, so the engine needs no JSON dependency).
pub fn fixture_prompts(json: &str) -> Vec<Vec<u32>> {
    let Some(start) = json.find("\"prompts\"") else {
        return Vec::new();
    };
    let body = &json[start + "\"prompts\"".len()..];
    let Some(open) = body.find('[') else {
        return Vec::new();
    };
    let (mut depth, mut end) = (0, open);
    for (i, c) in body[open..].char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth == 0 {
                    end = open + i;
                    break;
                }
            }
            _ => {}
        }
    }
    body[open + 1..end]
        .split(']')
        .filter_map(|p| {
            let p = p
                .trim_start_matches([',', ' ', '\n'])
                .trim_start_matches('[');
            let v: Vec<u32> = p.split(',').filter_map(|t| t.trim().parse().ok()).collect();
            (!v.is_empty()).then_some(v)
        })
        .collect()
}
