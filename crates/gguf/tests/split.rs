//! Split models: what `SplitWriter` writes opens from any shard as the whole
//! model, byte for byte the same tensors and metadata as the unsplit file;
//! shards that are missing, misnumbered, miscounted or overlapping are errors
//! naming the file.

use samesum_gguf::split::{
    KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, parse_split_path, split_path,
};
use samesum_gguf::*;
use std::path::{Path, PathBuf};

/// Seven tensors of assorted types and sizes (one of zero size) with data.
fn sample() -> (GgufWriter, Vec<Vec<u8>>) {
    let mut w = GgufWriter::new();
    w.set("general.architecture", "demo");
    w.set("demo.value", 42u32);
    let specs: &[(&str, &[u64], GgmlType)] = &[
        ("a", &[3, 5], GgmlType::F32),
        ("b", &[512, 2], GgmlType::Q4_K),
        ("c", &[64], GgmlType::Q8_0),
        ("d", &[0], GgmlType::F32),
        ("e", &[1000], GgmlType::F16),
        ("f", &[32, 3], GgmlType::Q8_0),
        ("g", &[7], GgmlType::F32),
    ];
    let mut data = Vec::new();
    for (i, (name, dims, ty)) in specs.iter().enumerate() {
        w.add_tensor(*name, dims, *ty).unwrap();
        let size = tensor_size(name, dims, *ty).unwrap() as usize;
        data.push((0..size).map(|j| (j * 13 + i * 5 + 1) as u8).collect());
    }
    (w, data)
}

/// Write `w` split at `max` tensors a shard under `dir/m.gguf`, in pieces.
fn write_split(w: &GgufWriter, data: &[Vec<u8>], dir: &Path, max: usize) -> Vec<PathBuf> {
    let mut sw = SplitWriter::new(w, &dir.join("m.gguf"), max).unwrap();
    for (t, d) in w.tensors().iter().zip(data) {
        assert_eq!(
            sw.next_tensor().map(|n| n.name.as_str()),
            Some(t.name.as_str())
        );
        if d.is_empty() {
            sw.write_tensor(&t.name, d).unwrap();
        }
        for piece in d.chunks(100) {
            sw.write_piece(piece).unwrap();
        }
    }
    assert!(!dir.join("m-00001-of-00003.gguf").exists() || max >= w.tensors().len());
    sw.finish().unwrap()
}

#[test]
fn split_names_follow_llama_cpp() {
    let p = split_path(Path::new("/x/model"), 0, 3);
    assert_eq!(p, Path::new("/x/model-00001-of-00003.gguf"));
    assert_eq!(
        parse_split_path(Path::new("/x/model-00002-of-00003.gguf")),
        Some((PathBuf::from("/x/model"), 1, 3))
    );
    for bad in [
        "/x/model.gguf",
        "/x/model-00000-of-00003.gguf",
        "/x/model-00004-of-00003.gguf",
        "/x/model-0001-of-00003.gguf",
        "/x/model-00001-of-00003.bin",
        "-00001-of-00003.gguf",
    ] {
        assert_eq!(parse_split_path(Path::new(bad)), None, "{bad}");
    }
}

#[test]
fn any_shard_opens_the_whole_model() {
    let (w, data) = sample();
    let dir = tempfile::tempdir().unwrap();
    let paths = write_split(&w, &data, dir.path(), 3);
    assert_eq!(paths.len(), 3);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 3, "only the three shards, no .partial files");
    for p in &paths {
        let f = GgufFile::open(p).unwrap();
        assert_eq!(f.shard_count(), 3);
        assert_eq!(f.paths(), paths.as_slice());
        let m = f.metadata();
        assert_eq!(m.get_str("general.architecture").unwrap(), "demo");
        assert_eq!(m.get_u32("demo.value").unwrap(), 42);
        assert_eq!(m.get_u16(KEY_SPLIT_NO).unwrap(), 0);
        assert_eq!(m.get_u16(KEY_SPLIT_COUNT).unwrap(), 3);
        assert_eq!(m.get_i32(KEY_SPLIT_TENSORS_COUNT).unwrap(), 7);
        let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "d", "e", "f", "g"]);
        for (t, d) in w.tensors().iter().zip(&data) {
            let got = f.tensor(&t.name).unwrap();
            assert_eq!((&got.dims, got.ggml_type), (&t.dims, t.ggml_type));
            assert_eq!(got.offset % 32, 0, "{}", t.name);
            assert_eq!(f.tensor_data(&t.name).unwrap(), d.as_slice(), "{}", t.name);
        }
    }
    // The later shards carry only the split keys and their own tensors.
    let one = |i: usize| Gguf::from_bytes(std::fs::read(&paths[i]).unwrap()).unwrap();
    let second = one(1);
    assert_eq!(second.metadata().len(), 3);
    assert_eq!(second.metadata().get_u16(KEY_SPLIT_NO).unwrap(), 1);
    assert_eq!(second.tensors().len(), 3);
    assert_eq!(one(2).tensors().len(), 1);
}

#[test]
fn split_of_one_and_unsplit_files_open_alone() {
    let (w, data) = sample();
    let dir = tempfile::tempdir().unwrap();
    let paths = write_split(&w, &data, dir.path(), 100);
    assert_eq!(paths, [dir.path().join("m-00001-of-00001.gguf")]);
    let f = GgufFile::open(&paths[0]).unwrap();
    assert_eq!((f.shard_count(), f.tensors().len()), (1, 7));
    // An unsplit file named like a shard is just a file.
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let p = dir.path().join("n-00001-of-00002.gguf");
    std::fs::write(&p, w.to_bytes(&refs).unwrap()).unwrap();
    assert_eq!(GgufFile::open(&p).unwrap().shard_count(), 1);
}

/// One shard written by hand: split keys (no, count, total) and the named
/// tensors (F32 [4]).
fn shard(path: &Path, keys: (u16, u16, i32), tensors: &[&str]) {
    let mut w = GgufWriter::new();
    if keys.0 == 0 {
        w.set("general.architecture", "demo");
    }
    w.set(KEY_SPLIT_NO, keys.0);
    w.set(KEY_SPLIT_COUNT, keys.1);
    w.set(KEY_SPLIT_TENSORS_COUNT, keys.2);
    for t in tensors {
        w.add_tensor(*t, &[4], GgmlType::F32).unwrap();
    }
    let data = vec![[0u8; 16].as_slice(); tensors.len()];
    std::fs::write(path, w.to_bytes(&data).unwrap()).unwrap();
}

fn open_err(p: &Path) -> String {
    match GgufFile::open(p) {
        Ok(_) => panic!("{} opened", p.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_splits_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = |i: usize, n: usize| split_path(&dir.path().join("m"), i, n);
    // A good three-shard model first, to be sure the hand-made shards are right.
    shard(&p(0, 3), (0, 3, 4), &["a", "b"]);
    shard(&p(1, 3), (1, 3, 4), &["c"]);
    shard(&p(2, 3), (2, 3, 4), &["d"]);
    assert_eq!(GgufFile::open(p(1, 3)).unwrap().tensors().len(), 4);

    // Missing shard: named in the error.
    std::fs::remove_file(p(2, 3)).unwrap();
    let e = open_err(&p(0, 3));
    assert!(
        e.contains("m-00003-of-00003.gguf") && e.contains("missing"),
        "{e}"
    );

    // Wrong split.no.
    shard(&p(2, 3), (1, 3, 4), &["d"]);
    let e = open_err(&p(0, 3));
    assert!(
        e.contains("m-00003-of-00003.gguf") && e.contains("split.no = 1"),
        "{e}"
    );

    // The same tensor in two shards.
    shard(&p(2, 3), (2, 3, 4), &["b"]);
    let e = open_err(&p(0, 3));
    assert!(
        e.contains("\"b\"") && e.contains("m-00001-of-00003.gguf") && e.contains("m-00003"),
        "{e}"
    );

    // Counts that disagree between shards.
    shard(&p(2, 3), (2, 2, 4), &["d"]);
    let e = open_err(&p(0, 3));
    assert!(
        e.contains("m-00003-of-00003.gguf") && e.contains("split.count = 2"),
        "{e}"
    );

    // Tensors that do not add up to split.tensors.count.
    shard(&p(2, 3), (2, 3, 4), &["d", "e"]);
    let e = open_err(&p(0, 3));
    assert!(
        e.contains("split.tensors.count = 4") && e.contains("5 tensors"),
        "{e}"
    );

    // A shard whose name does not follow the pattern.
    let odd = dir.path().join("odd.gguf");
    shard(&odd, (0, 3, 4), &["a", "b"]);
    let e = open_err(&odd);
    assert!(
        e.contains("odd.gguf") && e.contains("-00001-of-00003.gguf"),
        "{e}"
    );

    // A name that disagrees with the metadata.
    shard(&p(2, 3), (2, 3, 4), &["d"]);
    std::fs::copy(p(0, 3), p(1, 3)).unwrap();
    let e = open_err(&p(1, 3));
    assert!(
        e.contains("shard 2 of 3") && e.contains("split.no = 0"),
        "{e}"
    );

    // A corrupt shard: the error names it.
    std::fs::write(p(1, 3), b"GGUF\x03\0\0\0").unwrap();
    let e = open_err(&p(0, 3));
    assert!(
        e.contains("m-00002-of-00003.gguf") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn abandoned_split_write_leaves_no_file() {
    let (w, data) = sample();
    let dir = tempfile::tempdir().unwrap();
    {
        let mut sw = SplitWriter::new(&w, &dir.path().join("m.gguf"), 2).unwrap();
        for d in &data[..4] {
            if d.is_empty() {
                sw.write_tensor("d", d).unwrap();
            } else {
                sw.write_piece(d).unwrap();
            }
        }
        assert!(sw.finish().is_err(), "finish before all tensors must fail");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    assert!(SplitWriter::new(&w, &dir.path().join("m.gguf"), 0).is_err());
}
