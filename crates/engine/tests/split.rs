//! A model split into shards (llama.cpp's `gguf-split` layout) computes the
//! same logits, byte for byte, as the same model in one file, opened from any
//! of its shards.

use samesum_engine::cpu::Cpu;
use samesum_engine::{Backend, KvType, Logits, Model, forward};
use samesum_gguf::GgmlType;
use samesum_synth::{SynthOptions, shapes, write_model};

fn logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let cpu = Cpu::new(2);
    let mut st = cpu.new_state(model, prompt.len() + 1, KvType::F32).unwrap();
    forward(model, &cpu, &mut st, prompt, Logits::All).unwrap()
}

#[test]
fn split_model_gives_the_same_logits_as_one_file() {
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 400).collect();
    for shape in ["tiny-qwen3moe", "tiny-qwen35moe"] {
        let dir = tempfile::tempdir().unwrap();
        let opts = SynthOptions::new(shapes::by_name(shape).unwrap(), GgmlType::Q4_K, 3);
        let whole_path = dir.path().join("whole.gguf");
        let s = write_model(&opts, &whole_path, &mut |_, _| {}).unwrap();
        let split = opts.with_split_max_tensors(s.tensors.div_ceil(3));
        let s2 = write_model(&split, &dir.path().join("m.gguf"), &mut |_, _| {}).unwrap();
        assert_eq!(s2.files.len(), 3, "{shape}");
        let whole = Model::load(&whole_path).unwrap();
        let want = logits(&whole, &prompt);
        assert!(want.iter().all(|x| x.is_finite()));
        for f in &s2.files {
            let m = Model::load(f).unwrap();
            assert_eq!(m.file.shard_count(), 3);
            let got = logits(&m, &prompt);
            assert_eq!(got.len(), want.len());
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{shape}: logits of the split model opened from {} differ",
                f.display()
            );
        }
    }
}
