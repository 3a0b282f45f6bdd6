//! Fuzz the GGUF reader: any bytes must give Ok or a GgufError, never a panic,
//! and an accepted file's tensor views must lie inside it with the declared sizes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use samesum_gguf::Gguf;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = Gguf::from_bytes(data.to_vec()) {
        for t in g.tensors() {
            assert_eq!(g.data_of(t).len() as u64, t.size);
        }
        for (_, v) in g.metadata().iter() {
            let _ = v.to_string();
        }
    }
});
