//! Scoring a token sequence: the log-probability of each token given the
//! tokens before it, from the forward pass's logits for every row.
//!
//! Row `i` of a forward call's logits is the model's prediction for token
//! `i + 1`; its log-softmax is taken with the max subtracted and the sum of
//! exponentials accumulated in f64 in vocabulary order (as llama-perplexity
//! does), so a token's log-probability is `x[t] - max - ln(sum)`. The rows
//! come from chunked prefill with every row's logits asked for, which by the
//! row contract are the bytes one-token replay gives; so are the scores.
//! `samesum perplexity` sums them; the server's prompt log-probabilities
//! (`echo`) are the same numbers with the top alternatives.

use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::forward::{Logits, forward_chunks};
use crate::model::Model;
use crate::state::KvType;

/// One scored position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token scored.
    pub token: u32,
    /// Its log-probability (natural log) given the tokens before it.
    pub logprob: f64,
    /// The most likely tokens at this position, most likely first (the lower
    /// id first on equal logits), with their log-probabilities.
    pub top: Vec<(u32, f64)>,
}

/// `max + ln(sum of exp(x - max))` of a row of logits: the max in f32, the
/// exponentials and their sum in f64 in index order.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln()
}

/// Score `token` against one row of logits, with the `top_n` most likely
/// tokens of the row.
pub fn score_row(row: &[f32], token: u32, top_n: usize) -> Result<TokenLogprob> {
    let Some(&x) = row.get(token as usize) else {
        return Err(EngineError::BadToken {
            token,
            vocab: row.len(),
        });
    };
    let lse = log_sum_exp(row);
    let mut top = Vec::new();
    if top_n > 0 {
        let mut ids: Vec<u32> = (0..row.len() as u32).collect();
        // Larger logit first, then the lower id; NaN sorts last.
        let order = |a: &u32, b: &u32| {
            let (xa, xb) = (row[*a as usize], row[*b as usize]);
            xb.partial_cmp(&xa)
                .unwrap_or_else(|| xa.is_nan().cmp(&xb.is_nan()))
                .then(a.cmp(b))
        };
        let n = top_n.min(ids.len());
        if n < ids.len() {
            ids.select_nth_unstable_by(n, order);
            ids.truncate(n);
        }
        ids.sort_by(order);
        top = ids
            .into_iter()
            .map(|i| (i, row[i as usize] as f64 - lse))
            .collect();
    }
    Ok(TokenLogprob {
        token,
        logprob: x as f64 - lse,
        top,
    })
}

/// Score `targets[i]` against row `i` of `logits` (rows of `n_vocab`).
pub fn score_logits(
    logits: &[f32],
    n_vocab: usize,
    targets: &[u32],
    top_n: usize,
) -> Result<Vec<TokenLogprob>> {
    if n_vocab == 0 || logits.len() != targets.len() * n_vocab {
        return Err(EngineError::Score(format!(
            "{} logits for {} targets of a vocabulary of {n_vocab}",
            logits.len(),
            targets.len()
        )));
    }
    logits
        .chunks_exact(n_vocab)
        .zip(targets)
        .map(|(row, &t)| score_row(row, t, top_n))
        .collect()
}

/// Run `tokens` through a fresh sequence (chunks of `chunk` rows, two at a
/// time as prefill runs them) and score every position from `first` on:
/// entry `j` is token `first + j` given `tokens[..first + j]`. Only the
/// chunks holding rows `first - 1 ..` ask for logits.
pub fn score_tokens<B: Backend>(
    b: &B,
    model: &Model,
    tokens: &[u32],
    first: usize,
    chunk: usize,
    kv: KvType,
    top_n: usize,
) -> Result<Vec<TokenLogprob>> {
    if first == 0 || first >= tokens.len() {
        return Err(EngineError::Score(format!(
            "positions from {first} of {} tokens: the first scored position must be at least 1 and inside the sequence",
            tokens.len()
        )));
    }
    let vocab = model.w.n_vocab;
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::BadToken { token: t, vocab });
    }
    let chunk = chunk.max(1);
    let mut st = b.new_state(model, tokens.len(), kv)?;
    let pieces: Vec<&[u32]> = tokens.chunks(chunk).collect();
    let mut out = Vec::with_capacity(tokens.len() - first);
    for (p, pair) in pieces.chunks(2).enumerate() {
        // Rows [r0, r1) of the whole sequence in this pair, and of them
        // those whose logits score a position (rows first-1 .. len-2).
        let r0 = 2 * p * chunk;
        let wanted = |j: usize| {
            let start = r0 + j * chunk;
            let end = start + pair[j].len();
            if end >= first {
                Logits::All
            } else {
                Logits::None
            }
        };
        let logits = forward_chunks(model, b, &mut st, pair, wanted)?;
        // The rows returned: every row of the pieces that asked.
        let mut row0 = None;
        for j in 0..pair.len() {
            if matches!(wanted(j), Logits::All) {
                row0.get_or_insert(r0 + j * chunk);
            }
        }
        let Some(row0) = row0 else { continue };
        let rows = logits.len() / vocab;
        for k in 0..rows {
            let r = row0 + k;
            if r + 1 < first || r + 1 >= tokens.len() {
                continue;
            }
            out.push(score_row(
                &logits[k * vocab..(k + 1) * vocab],
                tokens[r + 1],
                top_n,
            )?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_the_definition() {
        let row = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        let s = score_row(&row, 2, 3).unwrap();
        assert!((s.logprob - ((-2.0f64).exp() / z).ln()).abs() < 1e-12);
        // Top three: the two 3.0s (lower id first), then 1.0.
        let ids: Vec<u32> = s.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0]);
        assert!((s.top[0].1 - (3f64.exp() / z).ln()).abs() < 1e-12);
        let total: f64 = (0..5)
            .map(|t| score_row(&row, t, 0).unwrap().logprob.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert!(score_row(&row, 5, 0).is_err());
        assert!(score_logits(&row, 5, &[0, 1], 0).is_err());
        assert_eq!(score_logits(&row, 5, &[4], 9).unwrap()[0].top.len(), 5);
    }
}
