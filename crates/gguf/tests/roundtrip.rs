//! What the writer writes, the reader reads back identically: metadata of every
//! type (arrays of strings, arrays of arrays), tensor directory, aligned data.

use samesum_gguf::*;

fn sample() -> (GgufWriter, Vec<Vec<u8>>) {
    let mut w = GgufWriter::new();
    w.set("general.architecture", "qwen3moe");
    w.set("a.u8", 7u8);
    w.set("a.i8", -7i8);
    w.set("a.u16", 700u16);
    w.set("a.i16", -700i16);
    w.set("a.u32", 70_000u32);
    w.set("a.i32", -70_000i32);
    w.set("a.u64", u64::MAX);
    w.set("a.i64", i64::MIN);
    w.set("a.f32", 1.5f32);
    w.set("a.f64", -2.25f64);
    w.set("a.bool", true);
    w.set("a.str", "héllo");
    w.set("a.strs", Value::string_array(["a", "", "ünï"]));
    w.set("a.empty", Value::array(ValueType::I32, vec![]));
    w.set(
        "a.nested",
        Value::array(
            ValueType::Array,
            vec![
                Value::array(ValueType::U8, vec![Value::U8(1), Value::U8(2)]),
                Value::array(ValueType::U8, vec![]),
            ],
        ),
    );
    let specs: &[(&str, &[u64], GgmlType)] = &[
        ("t.f32", &[3, 5], GgmlType::F32),
        ("t.q4k", &[512, 2], GgmlType::Q4_K),
        ("t.q8_0", &[64], GgmlType::Q8_0),
        ("t.mxfp4", &[32, 1, 1, 3], GgmlType::MXFP4),
        ("t.bf16", &[1], GgmlType::BF16),
    ];
    let mut data = Vec::new();
    for (i, (name, dims, ty)) in specs.iter().enumerate() {
        w.add_tensor(*name, dims, *ty).unwrap();
        let size = tensor_size(name, dims, *ty).unwrap() as usize;
        data.push((0..size).map(|j| (j * 31 + i * 7) as u8).collect());
    }
    (w, data)
}

#[test]
fn round_trip_in_memory() {
    let (w, data) = sample();
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let bytes = w.to_bytes(&refs).unwrap();
    let f = Gguf::from_bytes(bytes).unwrap();
    assert_eq!(f.header().version, 3);
    assert_eq!(f.metadata(), w.metadata());
    for (t, d) in w.tensors().iter().zip(&data) {
        let got = f.tensor(&t.name).unwrap();
        assert_eq!(
            (&got.dims, got.ggml_type, got.size),
            (&t.dims, t.ggml_type, t.size)
        );
        assert_eq!(got.offset % 32, 0);
        assert_eq!(f.tensor_data(&t.name).unwrap(), d.as_slice());
    }
    let m = f.metadata();
    assert_eq!(m.get_u64("a.u64").unwrap(), u64::MAX);
    assert_eq!(m.get_str_array("a.strs").unwrap(), vec!["a", "", "ünï"]);
    assert_eq!(m.get_uint("a.u16").unwrap(), 700);
    assert_eq!(m.get_float("a.f32").unwrap(), 1.5);
}

#[test]
fn round_trip_through_a_file_with_custom_alignment() {
    let (mut w, data) = sample();
    w.set("general.alignment", 64u32);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    let mut dw = w.create(&path).unwrap();
    assert!(!path.exists(), "file must not appear before finish");
    for (t, d) in w.tensors().iter().zip(&data) {
        // Stream in small pieces.
        for piece in d.chunks(7) {
            dw.write_piece(piece).unwrap();
        }
        let _ = t;
    }
    dw.finish().unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.header().alignment, 64);
    for (t, d) in w.tensors().iter().zip(&data) {
        assert_eq!(f.tensor(&t.name).unwrap().offset % 64, 0);
        assert_eq!(f.tensor_data(&t.name).unwrap(), d.as_slice());
    }
}

#[test]
fn abandoned_write_leaves_no_file() {
    let (w, _) = sample();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    {
        let mut dw = w.create(&path).unwrap();
        dw.write_piece(&[0u8; 10]).unwrap();
        assert!(dw.finish().is_err(), "finish before all tensors must fail");
    }
    assert!(!path.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "partial file left behind"
    );
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[32], GgmlType::Q8_0).unwrap();
    assert!(matches!(
        w.add_tensor("a", &[32], GgmlType::F32),
        Err(GgufError::DuplicateTensor { .. })
    ));
    assert!(matches!(
        w.add_tensor("b", &[33], GgmlType::Q8_0),
        Err(GgufError::NotBlockMultiple { .. })
    ));
    assert!(matches!(
        w.add_tensor("c", &[1, 1, 1, 1, 1], GgmlType::F32),
        Err(GgufError::TooManyDims { .. })
    ));
    assert!(matches!(
        w.add_tensor("d", &[u64::MAX, 2], GgmlType::F32),
        Err(GgufError::DimOverflow { .. })
    ));
    // Wrong size and wrong order.
    assert!(w.to_bytes(&[&[0u8; 33]]).is_err());
    let mut w2 = GgufWriter::new();
    w2.set("k", Value::array(ValueType::U8, vec![Value::U32(1)]));
    assert!(matches!(w2.to_bytes(&[]), Err(GgufError::WrongType { .. })));
}

#[test]
fn typed_getters_name_key_and_found_type() {
    let (w, data) = sample();
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let f = Gguf::from_bytes(w.to_bytes(&refs).unwrap()).unwrap();
    let e = f.metadata().get_u32("a.str").unwrap_err().to_string();
    assert!(
        e.contains("a.str") && e.contains("u32") && e.contains("string"),
        "{e}"
    );
    let e = f.metadata().get_str("missing.key").unwrap_err().to_string();
    assert!(e.contains("missing.key"), "{e}");
    let e = f
        .metadata()
        .get_str_array("a.nested")
        .unwrap_err()
        .to_string();
    assert!(e.contains("array[array[u8]]"), "{e}");
    assert!(matches!(
        f.tensor("nope"),
        Err(GgufError::TensorNotFound { .. })
    ));
}
