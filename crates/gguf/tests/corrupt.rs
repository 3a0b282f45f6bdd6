//! Bad input gives a specific error and never panics: truncation at every byte,
//! random corruption (property test), and one hand-made file per failure kind.

use proptest::prelude::*;
use samesum_gguf::*;

fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", "test");
    w.set("tokens", Value::string_array(["a", "bb", "ccc"]));
    w.set(
        "nested",
        Value::array(
            ValueType::Array,
            vec![Value::array(ValueType::I32, vec![Value::I32(5)])],
        ),
    );
    w.set("f", 0.5f32);
    w.add_tensor("x", &[32, 2], GgmlType::Q8_0).unwrap();
    w.add_tensor("y", &[8], GgmlType::F32).unwrap();
    w.to_bytes(&[&[1u8; 68], &[2u8; 32]]).unwrap()
}

#[test]
fn truncation_at_every_byte_is_an_error() {
    let f = valid_file();
    assert!(Gguf::from_bytes(f.clone()).is_ok());
    for len in 0..f.len() {
        let r = Gguf::from_bytes(f[..len].to_vec());
        assert!(
            r.is_err(),
            "truncated to {len} of {} bytes was accepted",
            f.len()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn random_corruption_never_panics(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 1..8),
                                      cut in any::<usize>()) {
        let mut f = valid_file();
        for (pos, byte) in edits {
            let i = pos % f.len();
            f[i] = byte;
        }
        let cut = cut % (f.len() + 1);
        f.truncate(cut);
        // Must return (Ok or Err), never panic; an Ok file must be self-consistent.
        if let Ok(g) = Gguf::from_bytes(f) {
            for t in g.tensors() {
                prop_assert_eq!(g.data_of(t).len() as u64, t.size);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut f = b"GGUF\x03\x00\x00\x00".to_vec();
        f.extend_from_slice(&bytes);
        let _ = Gguf::from_bytes(f);
    }
}

/// A raw header builder for hand-made bad files.
struct Raw(Vec<u8>);
impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut v = b"GGUF".to_vec();
        v.extend_from_slice(&version.to_le_bytes());
        v.extend_from_slice(&n_tensors.to_le_bytes());
        v.extend_from_slice(&n_kv.to_le_bytes());
        Raw(v)
    }
    fn str(mut self, s: &str) -> Self {
        self.0.extend_from_slice(&(s.len() as u64).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(ty).u64(offset)
    }
    fn pad_data(mut self, data_len: usize) -> Vec<u8> {
        let n = self.0.len().div_ceil(32) * 32;
        self.0.resize(n + data_len, 0);
        self.0
    }
}

fn err(bytes: Vec<u8>) -> GgufError {
    match Gguf::from_bytes(bytes) {
        Ok(_) => panic!("accepted a bad file"),
        Err(e) => e,
    }
}

#[test]
fn specific_errors() {
    assert!(matches!(
        err(b"GGUX\x03\0\0\0".to_vec()),
        GgufError::BadMagic { .. }
    ));
    assert!(matches!(
        err(Raw::new(1, 0, 0).0),
        GgufError::UnsupportedVersion { found: 1 }
    ));
    assert!(matches!(
        err(Raw::new(4, 0, 0).0),
        GgufError::UnsupportedVersion { found: 4 }
    ));
    assert!(matches!(
        err(Raw::new(3 << 24, 0, 0).0),
        GgufError::BigEndian { .. }
    ));
    assert!(matches!(
        err(Raw::new(3, 0, u64::MAX).0),
        GgufError::CountTooLarge { .. }
    ));
    assert!(matches!(
        err(Raw::new(3, u64::MAX / 2, 0).0),
        GgufError::CountTooLarge { .. }
    ));
    // A string whose length runs past the end.
    let e = err(Raw::new(3, 0, 1).u64(1 << 40).u32(4).u32(0).0);
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    // An array count far beyond the file.
    let e = err(Raw::new(3, 0, 1).str("k").u32(9).u32(4).u64(1 << 50).0);
    assert!(matches!(e, GgufError::CountTooLarge { .. }), "{e}");
    // Unknown value type, and arrays nested too deep.
    assert!(matches!(
        err(Raw::new(3, 0, 1).str("k").u32(13).0),
        GgufError::UnknownValueType { type_id: 13, .. }
    ));
    let mut deep = Raw::new(3, 0, 1).str("k").u32(9);
    for _ in 0..20 {
        deep = deep.u32(9).u64(1);
    }
    assert!(matches!(
        err(deep.u32(0).u64(0).0),
        GgufError::NestingTooDeep { .. }
    ));
    // Invalid UTF-8 in a key.
    let mut bad = Raw::new(3, 0, 1).0;
    bad.extend_from_slice(&2u64.to_le_bytes());
    bad.extend_from_slice(&[0xff, 0xfe]);
    bad.extend_from_slice(&4u32.to_le_bytes());
    bad.extend_from_slice(&0u32.to_le_bytes());
    assert!(matches!(err(bad), GgufError::InvalidUtf8 { .. }));
    // Duplicate key.
    let dup = Raw::new(3, 0, 2)
        .str("k")
        .u32(4)
        .u32(1)
        .str("k")
        .u32(4)
        .u32(2)
        .0;
    assert!(matches!(err(dup), GgufError::DuplicateKey { .. }));
    // Bad alignment values and types.
    assert!(matches!(
        err(Raw::new(3, 0, 1).str("general.alignment").u32(4).u32(24).0),
        GgufError::BadAlignment { value: 24 }
    ));
    assert!(matches!(
        err(Raw::new(3, 0, 1).str("general.alignment").u32(4).u32(0).0),
        GgufError::BadAlignment { value: 0 }
    ));
    assert!(matches!(
        err(Raw::new(3, 0, 1).str("general.alignment").u32(10).u64(32).0),
        GgufError::WrongType { .. }
    ));
    // Tensor problems.
    let t = |name: &str, dims: &[u64], ty: u32, off: u64, data: usize| {
        err(Raw::new(3, 1, 0).tensor(name, dims, ty, off).pad_data(data))
    };
    assert!(matches!(
        t("x", &[4], 4, 0, 64),
        GgufError::UnknownGgmlType { type_id: 4, .. }
    ));
    assert!(matches!(
        t("x", &[4], 999, 0, 64),
        GgufError::UnknownGgmlType { .. }
    ));
    assert!(matches!(
        t("x", &[1, 1, 1, 1, 1], 0, 0, 64),
        GgufError::TooManyDims { .. }
    ));
    assert!(matches!(
        t("x", &[1 << 32, 1 << 32, 4], 0, 0, 64),
        GgufError::DimOverflow { .. }
    ));
    assert!(matches!(
        t("x", &[u64::MAX / 2], 0, 0, 64),
        GgufError::DimOverflow { .. }
    ));
    assert!(matches!(
        t("x", &[33], 8, 0, 64),
        GgufError::NotBlockMultiple { .. }
    ));
    assert!(matches!(
        t("x", &[4], 0, 8, 64),
        GgufError::Misaligned { .. }
    ));
    assert!(matches!(
        t("x", &[32], 0, 0, 64),
        GgufError::OutOfBounds { .. }
    ));
    assert!(matches!(
        t("x", &[4], 0, u64::MAX - 31, 64),
        GgufError::OutOfBounds { .. }
    ));
    let e = t("x", &[4], 0, 0, 0);
    assert!(
        matches!(
            e,
            GgufError::DataSectionMissing { .. } | GgufError::OutOfBounds { .. }
        ),
        "{e}"
    );
    // Overlap and duplicates.
    let two = |a: u64, b: u64, nb: &str| {
        err(Raw::new(3, 2, 0)
            .tensor("a", &[16], 0, a)
            .tensor(nb, &[16], 0, b)
            .pad_data(256))
    };
    assert!(matches!(two(0, 32, "b"), GgufError::Overlap { .. }));
    assert!(matches!(two(0, 64, "a"), GgufError::DuplicateTensor { .. }));
    assert!(
        Gguf::from_bytes(
            Raw::new(3, 2, 0)
                .tensor("a", &[16], 0, 0)
                .tensor("b", &[16], 0, 64)
                .pad_data(128)
        )
        .is_ok()
    );
    // Error messages carry the context.
    let msg = t("blk.0.ffn_up_exps.weight", &[32], 0, 0, 64).to_string();
    assert!(
        msg.contains("blk.0.ffn_up_exps.weight") && msg.contains("128") && msg.contains("64"),
        "{msg}"
    );
}

#[test]
fn version_2_files_are_read() {
    let mut f = valid_file();
    f[4..8].copy_from_slice(&2u32.to_le_bytes());
    let g = Gguf::from_bytes(f).unwrap();
    assert_eq!(g.header().version, 2);
    assert_eq!(
        g.metadata().get_str_array("tokens").unwrap(),
        vec!["a", "bb", "ccc"]
    );
}
