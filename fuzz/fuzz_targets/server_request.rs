//! Fuzz the request path of `samesum serve` up to the scheduler: a body's
//! bytes are parsed as a chat and as a completion request
//! (`samesum_server::api::parse`), validated (`check`), and an accepted chat
//! is rendered with a chat template and tokenized, as the handlers do. The
//! tokenizers are the synthetic models' (built from metadata alone; no
//! weights are needed), with their own template and, where `../shared/` is
//! beside the checkout, with each real Qwen template. Any body must give
//! settings in range or a 400 whose JSON body round-trips, never a panic; the
//! synthetic template renders every accepted chat (a real template may
//! refuse one, as the server reports). Seeds: `fuzz/request_seeds/`;
//! dictionary: `fuzz/request.dict`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use samesum_engine::tokenizer::Tokenizer;
use samesum_gguf::GgmlType;
use samesum_server::api::{self, ApiError, ChatRequest, CompletionRequest, Settings};
use samesum_synth::{SynthOptions, describe, shapes};
use std::sync::OnceLock;

/// The qwen2 and qwen35 tokenizers of the synthetic models, each with the
/// synthetic template (`true`: it must render) and with the real ones found.
fn tokenizers() -> &'static [(Tokenizer, bool)] {
    static TOK: OnceLock<Vec<(Tokenizer, bool)>> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/qwen-tokenizer-ref/templates");
        let real: Vec<String> = [
            "qwen3",
            "qwen3-next-instruct",
            "qwen3-next-thinking",
            "qwen3.5",
        ]
        .iter()
        .filter_map(|n| std::fs::read_to_string(dir.join(format!("{n}.jinja"))).ok())
        .collect();
        let mut out = Vec::new();
        for shape in ["tiny-qwen3next", "tiny-qwen35moe"] {
            let opts = SynthOptions::new(shapes::by_name(shape).unwrap(), GgmlType::Q8_0, 0);
            let (w, _) = describe(&opts).unwrap();
            let tok = || Tokenizer::from_metadata(w.metadata()).unwrap();
            out.push((tok(), true));
            for t in &real {
                let mut k = tok();
                k.chat_template = Some(t.clone());
                out.push((k, false));
            }
        }
        out
    })
}

fn check_error(e: &ApiError) {
    assert_eq!(e.status, 400, "{e:?}");
    assert!(!e.message.is_empty());
    let body = serde_json::to_vec(&e.body()).unwrap();
    let back: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(back["error"]["message"], e.message.as_str());
}

fn check_settings(s: &Settings, max_logprobs: usize) {
    assert!((0.0..=2.0).contains(&s.temperature));
    assert!((0.0..=1.0).contains(&s.top_p));
    assert!((0.0..=1.0).contains(&s.min_p));
    assert!((0.0..=10.0).contains(&s.repeat_penalty));
    assert!((-2.0..=2.0).contains(&s.penalties.presence));
    assert!((-2.0..=2.0).contains(&s.penalties.frequency));
    assert!(s.top_k <= 1 << 20);
    assert!(s.repeat_last_n.is_none_or(|n| n <= 1 << 20));
    assert!(s.max_tokens.is_none_or(|n| n <= u32::MAX as usize));
    assert!(s.stop.len() <= 4 && s.stop.iter().all(|x| !x.is_empty()));
    assert!(s.logit_bias.windows(2).all(|w| w[0].0 <= w[1].0));
    assert!(s.logit_bias.iter().all(|b| (-100.0..=100.0).contains(&b.1)));
    assert!(s.logprobs.is_none_or(|n| n <= max_logprobs));
}

fuzz_target!(|data: &[u8]| {
    let toks = tokenizers();
    let (tok, must_render) = &toks[data.len() % toks.len()];
    match api::parse::<ChatRequest>(data).and_then(|r| r.check()) {
        Ok((p, s)) => {
            check_settings(&s, 20);
            assert!(!p.pairs().is_empty());
            let rendered = tok.render_chat(&samesum_engine::tokenizer::ChatInput {
                messages: &p.messages,
                tools: p.tools.as_ref(),
                kwargs: &p.kwargs,
                add_generation_prompt: true,
            });
            match rendered {
                Ok(text) => {
                    let ids = tok.encode(&text).expect("text encodes");
                    assert!(ids.iter().all(|&i| (i as usize) < tok.len()));
                }
                Err(e) => assert!(!must_render, "the synthetic template failed: {e}"),
            }
        }
        Err(e) => check_error(&e),
    }
    match api::parse::<CompletionRequest>(data).and_then(|r| r.check()) {
        Ok((prompts, s)) => {
            check_settings(&s, 5);
            assert!(!prompts.is_empty() && prompts.len() * s.n <= api::MAX_PROMPTS);
            for p in prompts {
                if let api::PromptInput::Text(prompt) = p {
                    let ids = tok.encode(&prompt).expect("text encodes");
                    assert!(ids.iter().all(|&i| (i as usize) < tok.len()));
                }
            }
        }
        Err(e) => check_error(&e),
    }
});
