//! Constrained sampling (structured output): a [`Constraint`] says which
//! tokens may come next, and the sampler draws only among those.
//!
//! The constraint acts on the sampler's copy of the logits, after the logit
//! bias and the penalties and before top-k/top-p/min-p and temperature, by
//! giving the tokens it rules out a logit of minus infinity. The model's
//! logits are never changed, so a constrained request's logits (and its
//! log-probabilities, which are the model's) are the same bytes as the
//! unconstrained request's up to the first token where the two samples
//! differ, and batch invariance holds: the mask depends only on the
//! request's own tokens. The engine knows no grammar: the server builds the
//! constraint (from a JSON schema, a grammar, a tool list).

use std::sync::{Arc, Mutex};

/// Which tokens may be sampled next.
pub trait Constraint: Send {
    /// Clear `allowed[t]` for each token `t` that may not come next; return
    /// whether the output is complete as it stands (an end-of-text token
    /// may come next). An error ends the request.
    fn mask(&mut self, allowed: &mut [bool]) -> Result<bool, String>;
    /// Advance past the sampled token (never an end-of-text token).
    fn commit(&mut self, token: u32) -> Result<(), String>;
    /// Whether the output is complete and nothing more may follow.
    fn stopped(&self) -> bool;
}

/// A constraint a [`crate::sched::Request`] carries. Clones share one
/// state: give each request its own.
#[derive(Clone)]
pub struct SharedConstraint(pub Arc<Mutex<Box<dyn Constraint>>>);

impl SharedConstraint {
    /// Wrap `c`.
    pub fn new(c: impl Constraint + 'static) -> Self {
        SharedConstraint(Arc::new(Mutex::new(Box::new(c))))
    }
}

impl std::fmt::Debug for SharedConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedConstraint")
    }
}

/// What the constraint lets the sampler do at one step.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Sample among the allowed tokens.
    Sample(Vec<bool>),
    /// The output is complete (or the constraint failed): end the request.
    End,
}

/// The mask of `c` for a vocabulary of `n` tokens, with the request's stop
/// tokens allowed exactly when the output is complete.
pub fn step(c: &mut dyn Constraint, n: usize, stop_tokens: &[u32]) -> Step {
    if c.stopped() {
        return Step::End;
    }
    let mut allowed = vec![true; n];
    let complete = match c.mask(&mut allowed) {
        Ok(done) => done,
        Err(_) => return Step::End,
    };
    for &s in stop_tokens {
        if let Some(a) = allowed.get_mut(s as usize) {
            *a = complete;
        }
    }
    if allowed.iter().any(|&a| a) {
        Step::Sample(allowed)
    } else {
        Step::End
    }
}
