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

/// llama.cpp's tokenizer test vectors for Qwen's vocabulary
/// (`ggml-vocab-qwen2.gguf.inp` / `.out`, made by Hugging Face's tokenizer),
/// on the vocabulary file llama.cpp ships beside them. Neither is in this
/// repository: `scripts/test.sh` takes them from the pinned llama.cpp
/// sources (`scripts/qwen2-vocab.sh`) and passes the vocabulary's path in
/// `SAMESUM_QWEN2_VOCAB`; the vectors are read from beside it.
#[test]
#[ignore = "needs SAMESUM_QWEN2_VOCAB (scripts/test.sh provides it)"]
fn llama_cpp_qwen2_vectors() {
    let vocab = std::env::var("SAMESUM_QWEN2_VOCAB").expect("SAMESUM_QWEN2_VOCAB");
    // The vectors beside the vocabulary (as scripts/qwen2-vocab.sh leaves
    // them), else the shared reference copy.
    let beside = std::path::Path::new(&vocab)
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let refdir = if beside.join("ggml-vocab-qwen2.gguf.inp").is_file() {
        beside
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/qwen-tokenizer-ref/llamacpp")
    };
    let f = GgufFile::open(&vocab).unwrap();
    let tok = Tokenizer::from_metadata(f.metadata()).unwrap();
    let inp = std::fs::read_to_string(refdir.join("ggml-vocab-qwen2.gguf.inp")).unwrap();
    let out = std::fs::read_to_string(refdir.join("ggml-vocab-qwen2.gguf.out")).unwrap();
    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    if texts.last() == Some(&"") {
        texts.pop();
    }
    let want: Vec<&str> = out.lines().collect();
    assert_eq!(texts.len(), want.len(), "inputs vs outputs");
    let mut bad = Vec::new();
    for (text, line) in texts.iter().zip(&want) {
        let want: Vec<u32> = line
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect();
        let got = tok.encode(text).unwrap();
        if got != want {
            bad.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        // Every vector decodes back to its text.
        assert_eq!(tok.decode(&got).unwrap(), *text, "round trip of {text:?}");
    }
    assert!(
        bad.is_empty(),
        "{} of {} vectors differ:\n{}",
        bad.len(),
        want.len(),
        bad.join("\n")
    );
    assert_eq!(want.len(), 46);
}

fn synth_tokenizer(shape: &str, template: Option<&str>) -> Tokenizer {
    use samesum_synth::{SynthOptions, shapes, write_model};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    let mut opts = SynthOptions::new(
        shapes::by_name(shape).unwrap(),
        samesum_gguf::GgmlType::Q8_0,
        1,
    );
    if let Some(t) = template {
        opts = opts.with_chat_template(t);
    }
    write_model(&opts, &p, &mut |_, _| {}).unwrap();
    let f = GgufFile::open(&p).unwrap();
    Tokenizer::from_metadata(f.metadata()).unwrap()
}

/// Decomposed and compatibility characters tokenize as their NFC form, on
/// both pre-tokenizers (Qwen's tokenizers normalize to NFC first).
#[test]
fn text_is_nfc_normalized_before_splitting() {
    for shape in ["tiny-qwen3moe", "tiny-qwen35moe"] {
        let tok = synth_tokenizer(shape, None);
        for (raw, nfc) in [
            ("A\u{30A}pfel", "\u{C5}pfel"),
            ("caf\u{65}\u{301} cre\u{300}me", "caf\u{E9} cr\u{E8}me"),
            ("\u{2126}hm and \u{212A}elvin", "\u{3A9}hm and Kelvin"),
            ("\u{1100}\u{1161}\u{11A8}", "\u{AC01}"),
        ] {
            let got = tok.encode(raw).unwrap();
            assert_eq!(got, tok.encode(nfc).unwrap(), "{shape}: {raw:?}");
            // Not the bytes of the raw text: normalization did something.
            assert_eq!(tok.decode(&got).unwrap(), nfc, "{shape}: {raw:?}");
        }
    }
}

/// User-defined tokens (`<think>`, `<tool_call>`, ...) are matched whole and
/// written out when decoded; control tokens are matched whole and left out.
/// `token_bytes` gives a byte token's raw byte, also half a character.
#[test]
fn user_defined_tokens_are_decoded_and_control_tokens_are_not() {
    let tok = synth_tokenizer("tiny-qwen3moe", None);
    let think = tok.encode("<think>").unwrap();
    let end = tok.encode("</think>").unwrap();
    let im_end = tok.encode("<|im_end|>").unwrap();
    assert_eq!((think.len(), end.len(), im_end.len()), (1, 1, 1));
    assert!(!tok.is_control(think[0]) && tok.is_control(im_end[0]));
    let ids = tok.encode("<think>\nhm</think>\n\nyes<|im_end|>").unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), "<think>\nhm</think>\n\nyes");
    let mut s = tok.stream();
    let streamed: String = ids.iter().map(|&i| s.push(i).unwrap()).collect();
    assert_eq!(streamed, "<think>\nhm</think>\n\nyes");
    assert_eq!(tok.token_bytes(think[0]), b"<think>");
    assert_eq!(tok.token_bytes(im_end[0]), b"<|im_end|>");
    // "é" is two bytes: byte tokens give each byte alone.
    for b in "é".bytes() {
        let id = (0..tok.len() as u32)
            .find(|&i| tok.token_bytes(i) == [b])
            .expect("byte token");
        assert_eq!(tok.token_bytes(id), vec![b]);
    }
    let all: Vec<u8> = tok
        .encode("naïve 日本")
        .unwrap()
        .iter()
        .flat_map(|&i| tok.token_bytes(i))
        .collect();
    assert_eq!(all, "naïve 日本".as_bytes());
}

/// The real Qwen3 template renders tools, tool calls, tool results and
/// `enable_thinking` as transformers does: tool schemas as Python's
/// `json.dumps` writes them (key order kept, `", "`/`": "`, nothing
/// HTML-escaped), the thinking switch from the caller's kwargs, and the
/// template's own default when none is given.
#[test]
fn qwen3_template_renders_tools_and_thinking() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/qwen-tokenizer-ref/templates/qwen3.jinja");
    let Ok(template) = std::fs::read_to_string(&path) else {
        eprintln!("skipped: {} is not there", path.display());
        return;
    };
    use samesum_engine::tokenizer::ChatInput;
    use serde_json::json;
    let tok = synth_tokenizer("tiny-qwen3moe", Some(&template));
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather <now> & later", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]);
    let render = |kwargs: serde_json::Value| {
        tok.render_chat(&ChatInput {
            messages: &messages,
            tools: Some(&tools),
            kwargs: kwargs.as_object().unwrap(),
            add_generation_prompt: true,
        })
        .unwrap()
    };
    let default = render(json!({}));
    assert!(
        default.contains(r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#),
        "{default}"
    );
    assert!(default.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"), "{default}");
    assert!(
        default.contains("<tool_response>\n18 C\n</tool_response>"),
        "{default}"
    );
    // Thinking on by default (the template's default): no empty think block.
    assert!(default.ends_with("<|im_start|>assistant\n"), "{default}");
    let off = render(json!({"enable_thinking": false}));
    assert!(
        off.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{off}"
    );
    assert_eq!(render(json!({"enable_thinking": true})), default);
}

/// The synthetic models' template: plain ChatML without tools; with tools,
/// the tool list in the system turn, calls and results in Qwen3's form,
/// and an empty think block when thinking is off.
#[test]
fn synthetic_template_renders_tools_like_qwen3() {
    use samesum_engine::tokenizer::ChatInput;
    use serde_json::json;
    let tok = synth_tokenizer("tiny-qwen3moe", None);
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C"},
        {"role": "tool", "content": "sunny"},
    ]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let off = json!({"enable_thinking": false});
    let text = tok
        .render_chat(&ChatInput {
            messages: &messages,
            tools: Some(&tools),
            kwargs: off.as_object().unwrap(),
            add_generation_prompt: true,
        })
        .unwrap();
    assert!(
        text.starts_with("<|im_start|>system\nBe brief.\n\n# Tools"),
        "{text}"
    );
    assert!(
        text.contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}\n</tools>"
        ),
        "{text}"
    );
    assert!(text.contains("<|im_start|>assistant\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"), "{text}");
    assert!(text.contains("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"), "{text}");
    assert!(
        text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{text}"
    );
    assert_eq!(
        tok.chat("Hi", Some("Be brief.")).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}
