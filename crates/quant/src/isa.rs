//! Instruction-set selection at run time.
//!
//! One binary runs on every x86-64 machine: SIMD kernels are compiled with
//! `#[target_feature]` and chosen here from what the CPU reports, never from
//! `target-cpu=native`. `SAMESUM_ISA=scalar|avx2|avx512|amx` caps the choice (for
//! comparisons and debugging); it can lower the level, never raise it above what the
//! CPU has.

use std::fmt;
use std::sync::OnceLock;

/// A kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable scalar reference.
    Scalar,
    /// AVX2 (with F16C for half-precision loads).
    Avx2,
    /// AVX-512 F + BW.
    Avx512,
    /// AVX-512 with AMX-INT8 tile multiplies for batched calls (one-row
    /// calls run the AVX-512 kernels).
    Amx,
}

impl Isa {
    /// Whether this CPU can run kernels of this family.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512.supported() && crate::dot::amx_available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every family this CPU supports, lowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx]
            .into_iter()
            .filter(|i| i.supported())
            .collect()
    }

    /// The best supported family, capped by `SAMESUM_ISA` if set (read once).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let top = *Isa::available().last().expect("scalar is always available");
            match std::env::var("SAMESUM_ISA")
                .ok()
                .as_deref()
                .and_then(Isa::parse)
            {
                Some(cap) if cap < top => cap,
                _ => top,
            }
        })
    }

    /// Parse `scalar`, `avx2`, `avx512` or `amx`.
    pub fn parse(s: &str) -> Option<Isa> {
        match s.to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "amx" => Some(Isa::Amx),
            _ => None,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
