//! The conformance bodies (`samesum_engine::conformance`) on the CPU
//! backend, for the three tiny architectures, at three threads (rows and
//! columns split unevenly among them; tests/ops.rs checks the row kernels
//! at one thread and at three against each other).

use samesum_engine::cpu::Cpu;

samesum_engine::conformance_tests! {
    backend = |_model| Some(Cpu::new(3))
}
