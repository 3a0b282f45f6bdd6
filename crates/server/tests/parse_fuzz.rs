//! The request path of `samesum serve` before the scheduler, on generated
//! bodies: bytes -> `api::parse` -> `check` -> chat template -> tokens, as the
//! chat and completion handlers run it.
//!
//! - Any body (generated JSON with every known field holding values of any
//!   type and size, nested messages and content parts, then possibly cut or
//!   corrupted) gives settings in range or a 400 whose JSON body round-trips,
//!   never a panic; an accepted chat renders with the synthetic template, and
//!   with each real Qwen template renders or is refused with an error; the
//!   text tokenizes to ids inside the vocabulary.
//! - A body whose every field is in range is accepted, and the settings hold
//!   exactly the values sent (the defaults where a field is absent); a chat
//!   renders to the turns it sent.
//!
//! `fuzz/fuzz_targets/server_request.rs` checks the first property without
//! bounds under cargo-fuzz. The real templates are read from
//! `../shared/qwen-tokenizer-ref/templates/` beside the checkout when it is
//! there.

use proptest::prelude::*;
use samesum_engine::tokenizer::Tokenizer;
use samesum_gguf::GgmlType;
use samesum_server::api::{self, ApiError, ChatRequest, CompletionRequest, Settings};
use samesum_synth::{SynthOptions, describe, shapes};
use serde_json::{Map, Value, json};
use std::sync::OnceLock;

/// The qwen2 and qwen35 tokenizers of the synthetic models, each with the
/// synthetic template (`true`) and with every real template found (`false`).
fn tokenizers() -> &'static [(Tokenizer, bool)] {
    static TOK: OnceLock<Vec<(Tokenizer, bool)>> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/qwen-tokenizer-ref/templates");
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

fn check_error(e: &ApiError) -> Result<(), TestCaseError> {
    prop_assert_eq!(e.status, 400, "{:?}", e);
    prop_assert!(!e.message.is_empty());
    let body = serde_json::to_vec(&e.body()).unwrap();
    let back: Value = serde_json::from_slice(&body).unwrap();
    prop_assert_eq!(&back["error"]["message"], e.message.as_str());
    prop_assert_eq!(
        back["error"]["param"].as_str(),
        e.param.as_deref(),
        "param round-trips"
    );
    Ok(())
}

fn check_settings(s: &Settings, max_logprobs: usize) -> Result<(), TestCaseError> {
    prop_assert!((0.0..=2.0).contains(&s.temperature), "{:?}", s);
    prop_assert!((0.0..=1.0).contains(&s.top_p), "{:?}", s);
    prop_assert!((0.0..=1.0).contains(&s.min_p), "{:?}", s);
    prop_assert!((0.0..=10.0).contains(&s.repeat_penalty), "{:?}", s);
    prop_assert!((-2.0..=2.0).contains(&s.penalties.presence), "{:?}", s);
    prop_assert!((-2.0..=2.0).contains(&s.penalties.frequency), "{:?}", s);
    prop_assert!(s.top_k <= 1 << 20);
    prop_assert!(s.repeat_last_n.is_none_or(|n| n <= 1 << 20));
    prop_assert!(s.max_tokens.is_none_or(|n| n <= u32::MAX as usize));
    prop_assert!(s.stop.len() <= 4 && s.stop.iter().all(|x| !x.is_empty()));
    prop_assert!(s.logit_bias.windows(2).all(|w| w[0].0 <= w[1].0));
    prop_assert!(s.logit_bias.iter().all(|b| (-100.0..=100.0).contains(&b.1)));
    prop_assert!(s.logprobs.is_none_or(|n| n <= max_logprobs));
    Ok(())
}

/// The chat and completion handlers' work on `body`, with the tokenizer
/// `which` picks, checked.
fn run_body(body: &[u8], which: usize) -> Result<(), TestCaseError> {
    let toks = tokenizers();
    let (tok, must_render) = &toks[which % toks.len()];
    match api::parse::<ChatRequest>(body).and_then(|r| r.check()) {
        Ok((p, s)) => {
            check_settings(&s, 20)?;
            let msgs = p.pairs();
            prop_assert!(!msgs.is_empty());
            prop_assert!(
                msgs.iter()
                    .all(|(r, _)| ["system", "user", "assistant", "tool"].contains(&r.as_str()))
            );
            let rendered = tok.render_chat(&samesum_engine::tokenizer::ChatInput {
                messages: &p.messages,
                tools: p.tools.as_ref(),
                kwargs: &p.kwargs,
                add_generation_prompt: true,
            });
            match rendered {
                Ok(text) => {
                    let ids = tok.encode(&text).unwrap();
                    prop_assert!(ids.iter().all(|&i| (i as usize) < tok.len()));
                }
                Err(e) => prop_assert!(!must_render, "the synthetic template failed: {}", e),
            }
        }
        Err(e) => check_error(&e)?,
    }
    match api::parse::<CompletionRequest>(body).and_then(|r| r.check()) {
        Ok((prompts, s)) => {
            check_settings(&s, 5)?;
            for p in prompts {
                if let api::PromptInput::Text(prompt) = p {
                    let ids = tok.encode(&prompt).unwrap();
                    prop_assert!(ids.iter().all(|&i| (i as usize) < tok.len()));
                }
            }
        }
        Err(e) => check_error(&e)?,
    }
    Ok(())
}

/// Strings that stress the template and the tokenizer.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "\\PC{0,24}",
        ".{0,8}",
        prop::sample::select(vec![
            "",
            "<|im_end|>",
            "<|im_start|>assistant\n",
            "<|endoftext|>",
            "<think>\nx\n</think>\n\ny",
            "</think>",
            "<tool_call>{}</tool_call>",
            "<tool_response>",
            "{{ messages }}",
            "{% raw %}",
            "\u{0}\u{7f}\u{ffff}\u{10ffff}",
            "é\u{301}ﬁ",
        ])
        .prop_map(String::from),
    ]
}

/// Any JSON value, leaning to the edges: huge and negative numbers,
/// non-integers, deep nesting, long strings.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN", |x| x.is_finite())
            .prop_map(Value::from),
        prop::sample::select(vec![
            json!(0),
            json!(1),
            json!(-1),
            json!(2),
            json!(0.5),
            json!(-0.0),
            json!(1e308),
            json!(-1e308),
            json!(4294967295u64),
            json!(4294967296u64),
            json!(u64::MAX),
            json!(i64::MIN),
            json!("none"),
            json!("auto"),
            json!("text"),
            json!({"type": "text"}),
            json!(["text"]),
            json!({}),
            json!([]),
        ]),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::vec(("[a-z_]{0,6}|type|text|role|content", inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn content_part() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => text().prop_map(|t| json!({"type": "text", "text": t})),
        1 => prop::sample::select(vec!["image_url", "input_audio", "file", ""])
            .prop_map(|t| json!({"type": t})),
        1 => any_json(),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        20 => prop::sample::select(vec!["system", "developer", "user", "assistant"])
            .prop_map(Value::from),
        1 => prop::sample::select(vec!["tool", "function", "", "USER"]).prop_map(Value::from),
        1 => any_json(),
    ];
    let content = prop_oneof![
        12 => text().prop_map(Value::from),
        3 => prop::collection::vec(content_part(), 0..4).prop_map(Value::from),
        1 => Just(Value::Null),
        1 => any_json(),
    ];
    let extra = prop::collection::vec(
        (
            prop::sample::select(vec![
                "tool_calls",
                "function_call",
                "audio",
                "name",
                "refusal",
                "reasoning_content",
            ]),
            prop_oneof![2 => Just(Value::Null), 2 => Just(json!([])), 1 => any_json()],
        ),
        0..2,
    );
    (prop::option::weighted(0.98, role), content, extra).prop_map(|(role, content, extra)| {
        let mut m = Map::new();
        if let Some(r) = role {
            m.insert("role".into(), r);
        }
        m.insert("content".into(), content);
        for (k, v) in extra {
            m.insert(k.into(), v);
        }
        Value::Object(m)
    })
}

const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "repeat_last_n",
    "seed",
    "stop",
    "stream",
    "n",
    "best_of",
    "ignore_eos",
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "user",
    "stream_options",
];

/// A request object: messages, a prompt, in-range sampling fields (mostly),
/// then a few of the known fields with any value.
fn any_request() -> impl Strategy<Value = Value> {
    let messages = prop_oneof![
        8 => prop::collection::vec(message(), 0..5).prop_map(Value::from),
        1 => any_json(),
    ];
    let prompt = prop_oneof![
        4 => text().prop_map(Value::from),
        2 => prop::collection::vec(text(), 0..3).prop_map(Value::from),
        1 => any_json(),
    ];
    let fields = prop::collection::vec((prop::sample::select(FIELDS), any_json()), 0..3);
    (
        prop::option::weighted(0.9, messages),
        prop::option::weighted(0.9, prompt),
        prop::option::weighted(0.7, valid_settings()),
        fields,
    )
        .prop_map(|(messages, prompt, valid, fields)| {
            let mut m = Map::new();
            if let Some(v) = messages {
                m.insert("messages".into(), v);
            }
            if let Some(v) = prompt {
                m.insert("prompt".into(), v);
            }
            for (k, v) in valid.map(|v| v.fields).unwrap_or_default() {
                m.insert(k.into(), v);
            }
            for (k, v) in fields {
                m.insert(k.into(), v);
            }
            Value::Object(m)
        })
}

/// `bytes` cut, with a byte replaced, or with a byte inserted (`how` picks).
fn corrupt(mut bytes: Vec<u8>, how: u8, at: usize, b: u8) -> Vec<u8> {
    let at = at % (bytes.len() + 1);
    match how % 4 {
        0 => bytes.truncate(at),
        1 if at < bytes.len() => bytes[at] = b,
        2 => bytes.insert(at, b),
        _ => {}
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Any body: settings in range or a 400, never a panic.
    #[test]
    fn any_body_is_refused_or_in_range(
        req in any_request(),
        how in any::<u8>(),
        at in any::<usize>(),
        b in any::<u8>(),
        which in any::<usize>(),
    ) {
        let bytes = serde_json::to_vec(&req).unwrap();
        run_body(&bytes, which)?;
        run_body(&corrupt(bytes, how, at, b), which)?;
    }

    /// Raw bytes, valid UTF-8 or not.
    #[test]
    fn any_bytes_are_refused_or_in_range(
        bytes in prop::collection::vec(any::<u8>(), 0..256),
        which in any::<usize>(),
    ) {
        run_body(&bytes, which)?;
    }
}

/// Sampling fields in range, as JSON, with the settings they must give.
#[derive(Debug, Clone)]
struct Valid {
    fields: Vec<(&'static str, Value)>,
    want: Settings,
}

fn valid_settings() -> impl Strategy<Value = Valid> {
    let unit = || prop::option::of(0.0f32..=1.0);
    (
        (
            prop::option::of(0.0f32..=2.0),
            unit(),
            unit(),
            prop::option::of(0.0f32..=10.0),
            prop::option::of(-2.0f32..=2.0),
            prop::option::of(-2.0f32..=2.0),
        ),
        (
            prop::option::of(0u64..=1 << 20),
            prop::option::of(-1i64..=1 << 20),
            prop::option::of(0u64..=u32::MAX as u64),
            any::<bool>(),
            prop::option::of(any::<u64>()),
            prop::option::of(any::<bool>()),
            prop::option::of(any::<bool>()),
        ),
        prop::option::of(prop::collection::vec("\\PC{1,6}", 0..=4)),
        prop::collection::btree_map(0u32..1000, -100.0f32..=100.0, 0..4),
    )
        .prop_map(
            |(
                (temp, top_p, min_p, rep, pres, freq),
                (top_k, last_n, max_tokens, alt, seed, stream, ignore_eos),
                stop,
                bias,
            )| {
                let mut fields: Vec<(&'static str, Value)> = Vec::new();
                for (k, v) in [
                    ("temperature", temp),
                    ("top_p", top_p),
                    ("min_p", min_p),
                    ("repeat_penalty", rep),
                    ("presence_penalty", pres),
                    ("frequency_penalty", freq),
                ] {
                    if let Some(v) = v {
                        fields.push((k, json!(v)));
                    }
                }
                if let Some(k) = top_k {
                    fields.push(("top_k", json!(k)));
                }
                if let Some(n) = last_n {
                    fields.push(("repeat_last_n", json!(n)));
                }
                if let Some(m) = max_tokens {
                    let key = if alt {
                        "max_completion_tokens"
                    } else {
                        "max_tokens"
                    };
                    fields.push((key, json!(m)));
                }
                if let Some(s) = seed {
                    fields.push(("seed", json!(s)));
                }
                if let Some(s) = stream {
                    fields.push(("stream", json!(s)));
                }
                if let Some(s) = ignore_eos {
                    fields.push(("ignore_eos", json!(s)));
                }
                if let Some(s) = &stop {
                    // One stop string may also be sent bare (`alt` picks
                    // the other spellings).
                    if s.len() == 1 && alt {
                        fields.push(("stop", json!(s[0])));
                    } else {
                        fields.push(("stop", json!(s)));
                    }
                }
                if !bias.is_empty() {
                    let m: Map<String, Value> = bias
                        .iter()
                        .map(|(k, v)| (k.to_string(), json!(v)))
                        .collect();
                    fields.push(("logit_bias", Value::Object(m)));
                }
                let want = Settings {
                    max_tokens: max_tokens.map(|m| m as usize),
                    temperature: temp.unwrap_or(1.0),
                    top_p: top_p.unwrap_or(1.0),
                    top_k: top_k.unwrap_or(0) as usize,
                    min_p: min_p.unwrap_or(0.0),
                    repeat_penalty: rep.unwrap_or(1.0),
                    penalties: samesum_engine::sample::Penalties {
                        presence: pres.unwrap_or(0.0),
                        frequency: freq.unwrap_or(0.0),
                    },
                    logit_bias: bias.into_iter().collect(),
                    repeat_last_n: match last_n {
                        None => Some(64),
                        Some(-1) => None,
                        Some(n) => Some(n as usize),
                    },
                    seed,
                    stop: stop.unwrap_or_default(),
                    stream: stream.unwrap_or(false),
                    logprobs: None,
                    ignore_eos: ignore_eos.unwrap_or(false),
                    format: None,
                    n: 1,
                    echo: false,
                };
                Valid { fields, want }
            },
        )
}

fn object(fields: &[(&'static str, Value)]) -> Map<String, Value> {
    fields
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    /// In-range chat requests are accepted with exactly the values sent, and
    /// the synthetic template renders the turns as sent.
    #[test]
    fn valid_chats_keep_their_values(
        v in valid_settings(),
        turns in prop::collection::vec(
            (prop::sample::select(vec!["system", "developer", "user", "assistant"]), text()),
            1..5,
        ),
        logprobs in prop::option::of(prop::option::of(0u64..=20)),
        which in any::<usize>(),
    ) {
        let mut m = object(&v.fields);
        m.insert(
            "messages".into(),
            turns.iter().map(|(r, t)| json!({"role": r, "content": t})).collect(),
        );
        let mut want = v.want.clone();
        if let Some(top) = logprobs {
            m.insert("logprobs".into(), json!(true));
            if let Some(n) = top {
                m.insert("top_logprobs".into(), json!(n));
            }
            want.logprobs = Some(top.unwrap_or(0) as usize);
        }
        let body = serde_json::to_vec(&Value::Object(m)).unwrap();
        let (p, s) = api::parse::<ChatRequest>(&body)
            .and_then(|r| r.check())
            .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        let msgs = p.pairs();
        prop_assert_eq!(&s, &want);
        let sent: Vec<(String, String)> = turns
            .iter()
            .map(|(r, t)| {
                let r = if *r == "developer" { "system" } else { r };
                (r.to_string(), t.clone())
            })
            .collect();
        prop_assert_eq!(&msgs, &sent);
        // The synthetic template writes each turn as is.
        let toks = tokenizers();
        let synthetic: Vec<&Tokenizer> =
            toks.iter().filter(|t| t.1).map(|t| &t.0).collect();
        let tok = synthetic[which % synthetic.len()];
        let pairs: Vec<(&str, &str)> = msgs.iter().map(|(r, t)| (r.as_str(), t.as_str())).collect();
        let text = tok.chat_messages(&pairs).unwrap();
        let mut expect = String::new();
        for (r, t) in &msgs {
            expect.push_str(&format!("<|im_start|>{r}\n{t}<|im_end|>\n"));
        }
        expect.push_str("<|im_start|>assistant\n");
        prop_assert_eq!(text, expect);
        run_body(&body, which)?;
    }

    /// In-range completion requests are accepted with exactly the values
    /// sent.
    #[test]
    fn valid_completions_keep_their_values(
        v in valid_settings(),
        prompt in text(),
        as_list in any::<bool>(),
        logprobs in prop::option::of(0u64..=5),
        which in any::<usize>(),
    ) {
        let mut m = object(&v.fields);
        m.insert(
            "prompt".into(),
            if as_list { json!([prompt]) } else { json!(prompt) },
        );
        let mut want = v.want.clone();
        if let Some(n) = logprobs {
            m.insert("logprobs".into(), json!(n));
            want.logprobs = Some(n as usize);
        }
        let body = serde_json::to_vec(&Value::Object(m)).unwrap();
        let (p, mut s) = api::parse::<CompletionRequest>(&body)
            .and_then(|r| r.check())
            .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        // Without a length the endpoint's default of 16 tokens applies,
        // either here or when the request is queued (then `None` here).
        if want.max_tokens.is_none() && s.max_tokens == Some(16) {
            s.max_tokens = None;
        }
        prop_assert_eq!(&s, &want);
        prop_assert_eq!(p, vec![api::PromptInput::Text(prompt)]);
        run_body(&body, which)?;
    }
}

#[test]
fn every_template_is_tried_when_shared_is_present() {
    let n = tokenizers().len();
    let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/qwen-tokenizer-ref/templates/qwen3.jinja");
    if shared.exists() {
        assert_eq!(n, 10, "two synthetic tokenizers, each with 1 + 4 templates");
    } else {
        assert_eq!(n, 2);
    }
}
