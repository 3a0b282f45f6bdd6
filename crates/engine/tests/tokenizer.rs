//! The tokenizer from GGUF metadata: golden ids from Hugging Face `tokenizers`
//! (the conformance fixtures' prompts were tokenized by it), round trips, special
//! tokens, chat templates, and errors for unsupported tokenizers.

use samesum_engine::tokenizer::Tokenizer;
use samesum_gguf::{Gguf, GgufFile, GgufWriter};
use std::path::PathBuf;

fn fixture(name: &str) -> GgufFile {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/conformance/fixtures")
        .join(name);
    GgufFile::open(p).unwrap()
}

#[test]
fn matches_hugging_face_on_the_fixture_prompts() {
    // make_fixtures.py tokenized these two texts with the HF tokenizer it trained;
    // the ids are the first two prompts of every fixture manifest.
    let f = fixture("qwen3moe.gguf");
    let tok = Tokenizer::from_metadata(f.metadata()).unwrap();
    let manifest = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/conformance/fixtures/qwen3moe.json"),
    )
    .unwrap();
    let texts = [
        "The quick brown fox jumps over the lazy dog.",
        "When the engine reads a prompt, it may compute the prompt one token at a time.",
    ];
    let start = manifest.find("\"prompts\"").unwrap();
    let body = &manifest[start..];
    for (i, text) in texts.iter().enumerate() {
        let ids = tok.encode(text).unwrap();
        let listed: Vec<String> = ids.iter().map(|x| x.to_string()).collect();
        // The manifest lists each prompt as a JSON array; find this one.
        let needle = listed.join(",\n  ");
        let compact: String = body.chars().filter(|c| !c.is_whitespace()).collect();
        assert!(
            compact.contains(&format!("[{}]", listed.join(","))),
            "prompt {i}: {ids:?} not in manifest ({needle})"
        );
        assert_eq!(tok.decode(&ids).unwrap(), *text);
    }
}

#[test]
fn round_trips_and_special_tokens_on_synthetic_vocabularies() {
    use samesum_synth::{SynthOptions, shapes, write_model};
    for shape in ["tiny-qwen3moe", "tiny-qwen35moe"] {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        let opts = SynthOptions::new(
            shapes::by_name(shape).unwrap(),
            samesum_gguf::GgmlType::Q8_0,
            1,
        );
        write_model(&opts, &p, &mut |_, _| {}).unwrap();
        let f = GgufFile::open(&p).unwrap();
        let tok = Tokenizer::from_metadata(f.metadata()).unwrap();
        for text in [
            "Hello, world! The experts route every token.",
            "naïve café — 日本語 🙂\n\ttabs  and  spaces",
            "",
        ] {
            let ids = tok.encode(text).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), text, "{shape}");
            let mut s = tok.stream();
            let streamed: String = ids.iter().map(|&i| s.push(i).unwrap()).collect();
            assert_eq!(streamed, text, "{shape}: streaming decode");
        }
        // Merges apply: common words take fewer tokens than bytes.
        let text = "the experts and the tokens";
        assert!(
            tok.encode(text).unwrap().len() < text.len() / 2,
            "{shape}: merges not applied"
        );
        let im_end = f.metadata().get_u32("tokenizer.ggml.eos_token_id").unwrap();
        assert_eq!(tok.encode("<|im_end|>").unwrap(), vec![im_end]);
        assert!(tok.stop.contains(&im_end));
        let chat = tok.chat("Hi there", Some("Be brief.")).unwrap();
        assert_eq!(
            chat,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = tok.encode(&chat).unwrap();
        assert_eq!(ids[0], tok.encode("<|im_start|>").unwrap()[0]);
    }
}

#[test]
fn unsupported_tokenizers_are_errors() {
    let f = fixture("qwen3moe.gguf");
    for (key, value, needle) in [
        ("tokenizer.ggml.pre", "llama-bpe", "qwen2, qwen35"),
        ("tokenizer.ggml.model", "llama", "gpt2"),
    ] {
        let mut w = GgufWriter::with_metadata(f.metadata().clone());
        w.set(key, value);
        let g = Gguf::from_bytes(w.to_bytes(&[]).unwrap()).unwrap();
        let e = Tokenizer::from_metadata(g.metadata())
            .err()
            .expect("accepted")
            .to_string();
        assert!(e.contains(value) && e.contains(needle), "{e}");
    }
}

/// The windowed stream decoder releases exactly the full decode, piece by
/// piece, on random id sequences (split multi-byte characters, invalid byte
/// runs, special tokens), and decodes only a short window per step.
#[test]
fn stream_decoding_equals_the_full_decode_on_random_ids() {
    use samesum_engine::tokenizer::StreamDecoder;
    use samesum_quant::rng::Rng;
    let f = fixture("qwen3moe.gguf");
    let tok = Tokenizer::from_metadata(f.metadata()).unwrap();
    let n = tok.len() as u64;
    let mut rng = Rng::new(3);
    let mut checked = 0;
    for case in 0..300 {
        let len = 1 + (rng.next_u64() % 80) as usize;
        let ids: Vec<u32> = (0..len).map(|_| rng.below(n) as u32).collect();
        let mut dec = StreamDecoder::new();
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&dec.push(&tok, id).unwrap());
        }
        text.push_str(&dec.flush(&tok).unwrap());
        assert_eq!(text, tok.decode(&ids).unwrap(), "case {case}: {ids:?}");
        checked += 1;
    }
    // Text with multi-byte characters split across byte tokens.
    let s = "naïve café — 日本語 🙂 done";
    let ids = tok.encode(s).unwrap();
    let mut dec = StreamDecoder::new();
    let pieces: Vec<String> = ids.iter().map(|&i| dec.push(&tok, i).unwrap()).collect();
    assert_eq!(pieces.concat(), s);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
    assert!(checked == 300);
}

/// A chat template whose loops would run for hours (it comes with the model
/// file, so anyone can write one) fails with a clear error in bounded time
/// instead of hanging; the model's own template still renders.
#[test]
fn a_runaway_chat_template_is_an_error_not_a_hang() {
    let f = fixture("qwen3moe.gguf");
    let mut tok = Tokenizer::from_metadata(f.metadata()).unwrap();
    if tok.chat_template.is_some() {
        assert!(tok.chat("Hello", None).is_ok());
    }
    tok.chat_template = Some(
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".into(),
    );
    // Without the bound this runs 10^10 iterations.
    let e = tok.chat("Hello", None).unwrap_err().to_string();
    assert!(e.contains("did not finish within"), "{e}");
}
