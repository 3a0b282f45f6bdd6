//! The samesum engine: models, the CPU backend, sequence state and the forward
//! pass (one code path for decode and prefill).

pub mod backend;
pub mod conformance;
pub mod constraint;
pub mod cpu;
mod cpu_backend;
pub mod ep;
mod error;
pub mod forward;
pub mod identity;
pub mod model;
pub mod plan;
pub mod pool;
pub mod sample;
pub mod sched;
pub mod score;
pub mod state;
pub mod tokenizer;

pub use backend::Backend;
pub use error::{EngineError, Result};
pub use forward::{
    BatchLogits, DEFAULT_CHUNK, Logits, Segment, forward, forward_batch, forward_chunks,
    forward_pair, forward_pair_misordered, layers_one, prefill,
};
pub use model::{Arch, HParams, Model};
pub use state::{KvType, SeqState};
