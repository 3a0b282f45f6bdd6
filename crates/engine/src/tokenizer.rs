//! The tokenizer, built from GGUF metadata with the `tokenizers` crate (pure Rust,
//! fancy-regex), and the chat template rendered with minijinja.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the
//! pre-tokenizers `qwen2` and `qwen35`; anything else is an error naming it.
//! Text is NFC-normalized before it is split, as Qwen's own tokenizers do
//! (`tokenizer.json`'s `NFC` normalizer for Qwen2, Qwen3 and Qwen3.5; llama.cpp
//! skips it for `qwen2`, so decomposed text tokenizes differently there).
//!
//! Token types follow llama.cpp: control tokens (GGUF type 3: `<|im_start|>`,
//! `<|im_end|>`, ...) and user-defined tokens (type 4: Qwen3's `<think>`,
//! `</think>`, `<tool_call>`, ...) are matched whole in the text; decoding
//! leaves control tokens out and writes user-defined ones as their text, as
//! llama.cpp's detokenizer and transformers' `skip_special_tokens` do.

use crate::error::{EngineError, Result};
use samesum_gguf::Metadata;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer as HfTokenizer};

/// The qwen2 pre-tokenizer split (Qwen3, Qwen3-MoE, Qwen3-Next).
pub const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The qwen35 pre-tokenizer split (Qwen3.5), applied after NFC.
pub const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the model's special tokens and chat template.
pub struct Tokenizer {
    inner: HfTokenizer,
    /// End-of-generation tokens (eos, plus control tokens that end a turn).
    pub stop: Vec<u32>,
    /// BOS id, if the model has one.
    pub bos: Option<u32>,
    /// Whether to prepend BOS.
    pub add_bos: bool,
    /// The chat template, if any.
    pub chat_template: Option<String>,
    tokens: Vec<String>,
    /// Per id: a control token (left out of decoded text).
    control: Vec<bool>,
    /// Per id: an added token, whose string is its text (not byte-level).
    added_text: Vec<bool>,
}

fn err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Build from GGUF metadata.
    pub fn from_metadata(m: &Metadata) -> Result<Tokenizer> {
        let model = m.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(err(format!(
                "tokenizer.ggml.model {model:?} is not supported (supported: gpt2)"
            )));
        }
        let pre = m.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let pattern = match pre {
            "qwen2" => QWEN2_SPLIT,
            "qwen35" => QWEN35_SPLIT,
            other => {
                return Err(err(format!(
                    "tokenizer.ggml.pre {other:?} is not supported (supported: qwen2, qwen35)"
                )));
            }
        };
        let tokens: Vec<String> = m
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(String::from)
            .collect();
        let types: Vec<i64> = match m.get("tokenizer.ggml.token_type") {
            Some(_) => m.get_int_array("tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        let merges: Vec<(String, String)> = match m.get("tokenizer.ggml.merges") {
            Some(_) => m
                .get_str_array("tokenizer.ggml.merges")?
                .into_iter()
                .map(|s| {
                    s.split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                        .ok_or_else(|| err(format!("merge {s:?} is not 'a b'")))
                })
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        let mut specials = Vec::new();
        let mut user_defined = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            // Every token keeps its GGUF id; control and user-defined tokens are also
            // matched whole in the text, before BPE.
            vocab.insert(t.clone(), i as u32);
            match types.get(i).copied().unwrap_or(1) {
                3 => specials.push((i as u32, t.clone())),
                4 => user_defined.push((i as u32, t.clone())),
                _ => {}
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(err)?;
        let mut inner = HfTokenizer::new(bpe);
        let split = Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(err)?;
        inner.with_pre_tokenizer(Some(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, false, false).into(),
        ])));
        inner.with_decoder(Some(ByteLevel::default()));
        inner.with_normalizer(Some(NFC)).map_err(err)?;
        // Added tokens keep their GGUF ids: the added vocabulary maps content to
        // the id the model was trained with. Control tokens are "special"
        // (left out when decoding), user-defined ones are not.
        let added = |list: &[(u32, String)], special: bool| -> Vec<AddedToken> {
            list.iter()
                .map(|(_, s)| AddedToken::from(s.clone(), special).normalized(false))
                .collect()
        };
        inner
            .add_special_tokens(added(&specials, true))
            .map_err(err)?;
        inner.add_tokens(added(&user_defined, false)).map_err(err)?;
        for (id, s) in specials.iter().chain(&user_defined) {
            if inner.token_to_id(s) != Some(*id) {
                return Err(err(format!(
                    "special token {s:?} would get id {:?}, the file says {id}",
                    inner.token_to_id(s)
                )));
            }
        }
        let n_tokens = tokens.len();
        let id = |k: &str| -> Result<Option<u32>> {
            match m.get_uint(k).ok() {
                Some(v) if v as usize >= n_tokens => Err(err(format!(
                    "{k} {v} is outside the vocabulary ({n_tokens} tokens)"
                ))),
                v => Ok(v.map(|v| v as u32)),
            }
        };
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let mut stop: Vec<u32> = eos.into_iter().collect();
        for (i, s) in &specials {
            if matches!(s.as_str(), "<|im_end|>" | "<|endoftext|>" | "<|eot_id|>")
                && !stop.contains(i)
            {
                stop.push(*i);
            }
        }
        let mut control = vec![false; n_tokens];
        for (i, _) in &specials {
            control[*i as usize] = true;
        }
        let mut added_text = vec![false; n_tokens];
        for (i, _) in specials.iter().chain(&user_defined) {
            added_text[*i as usize] = true;
        }
        Ok(Tokenizer {
            inner,
            control,
            added_text,
            stop,
            bos: id("tokenizer.ggml.bos_token_id")?,
            add_bos: m.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(false),
            chat_template: m.get_str("tokenizer.chat_template").ok().map(String::from),
            tokens,
        })
    }

    /// Tokenize `text` (special tokens in the text are recognized).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decode ids to text.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(err)
    }

    /// The token string of `id` (for diagnostics).
    pub fn token(&self, id: u32) -> &str {
        self.tokens
            .get(id as usize)
            .map(String::as_str)
            .unwrap_or("<?>")
    }

    /// The bytes token `id` stands for: a byte-level token's bytes (which
    /// may be part of a UTF-8 character), an added token's text; empty for
    /// an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(t) = self.tokens.get(id as usize) else {
            return Vec::new();
        };
        if self.added_text[id as usize] {
            return t.as_bytes().to_vec();
        }
        t.chars().map(|c| byte_of_char(c).unwrap_or(b'?')).collect()
    }

    /// Whether `id` is an added token (control or user-defined), matched
    /// whole in the text.
    pub fn is_added(&self, id: u32) -> bool {
        self.added_text.get(id as usize).copied().unwrap_or(false)
    }

    /// Whether `id` is a control token (`<|im_end|>`, ...), left out of
    /// decoded text.
    pub fn is_control(&self, id: u32) -> bool {
        self.control.get(id as usize).copied().unwrap_or(false)
    }

    /// Vocabulary size.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the vocabulary is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// A streaming decoder: feed ids, get text as soon as it is complete UTF-8.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tok: self,
            dec: StreamDecoder::new(),
        }
    }

    /// Render a one-turn chat prompt with the model's template.
    pub fn chat(&self, user: &str, system: Option<&str>) -> Result<String> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(("system", s));
        }
        messages.push(("user", user));
        self.chat_messages(&messages)
    }

    /// Render a conversation of `(role, content)` messages with the model's
    /// template, ending with the assistant's turn opened.
    pub fn chat_messages(&self, msgs: &[(&str, &str)]) -> Result<String> {
        let messages: Vec<serde_json::Value> = msgs
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        self.render_chat(&ChatInput {
            messages: &serde_json::Value::Array(messages),
            tools: None,
            kwargs: &serde_json::Map::new(),
            add_generation_prompt: true,
        })
    }

    /// Render a chat with the model's template: the messages as the OpenAI
    /// API gives them (objects with `role`, `content`, and where present
    /// `tool_calls`, `tool_call_id`, `reasoning_content`, ...), the tools,
    /// and the template's own variables (`enable_thinking`, ...) from
    /// `kwargs`. A variable the caller does not give keeps the template's
    /// default, as transformers renders it.
    pub fn render_chat(&self, input: &ChatInput<'_>) -> Result<String> {
        let tpl = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::Template("the model has no tokenizer.chat_template (use --no-chat)".into())
        })?;
        let mut env = minijinja::Environment::new();
        // A template comes with the model file: bound its work, so a loop
        // that does not end (or runs for hours) is an error, not a hang.
        env.set_fuel(Some(TEMPLATE_FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template("chat", tpl)
            .map_err(|e| EngineError::Template(e.to_string()))?;
        let bos = self
            .bos
            .map(|b| self.token(b).to_string())
            .unwrap_or_default();
        let eos = self
            .stop
            .first()
            .map(|&e| self.token(e).to_string())
            .unwrap_or_default();
        let mut ctx: std::collections::BTreeMap<String, minijinja::Value> = input
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from_serialize(v)))
            .collect();
        ctx.insert(
            "messages".into(),
            minijinja::Value::from_serialize(input.messages),
        );
        if let Some(t) = input.tools {
            ctx.insert("tools".into(), minijinja::Value::from_serialize(t));
        }
        ctx.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(input.add_generation_prompt),
        );
        ctx.entry("bos_token".into())
            .or_insert_with(|| minijinja::Value::from(bos));
        ctx.entry("eos_token".into())
            .or_insert_with(|| minijinja::Value::from(eos));
        env.get_template("chat")
            .and_then(|t| t.render(&ctx))
            .map_err(|e| {
                EngineError::Template(if e.kind() == minijinja::ErrorKind::OutOfFuel {
                    format!(
                        "the chat template did not finish within {TEMPLATE_FUEL} steps (a loop that does not end?)"
                    )
                } else {
                    e.to_string()
                })
            })
    }
}

/// What [`Tokenizer::render_chat`] renders.
#[derive(Clone, Copy, Debug)]
pub struct ChatInput<'a> {
    /// The messages, a JSON array of objects.
    pub messages: &'a serde_json::Value,
    /// The tools (OpenAI's `tools` array), if any.
    pub tools: Option<&'a serde_json::Value>,
    /// The template's other variables (`chat_template_kwargs`:
    /// `enable_thinking`, ...).
    pub kwargs: &'a serde_json::Map<String, serde_json::Value>,
    /// End with the assistant's turn opened.
    pub add_generation_prompt: bool,
}

/// The `tojson` filter as transformers defines it for chat templates:
/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)`, so keys keep
/// their order, `", "` and `": "` separate items (`","` with an indent), and
/// nothing is HTML-escaped (minijinja's own `tojson` escapes `<`, `>`, `&`
/// and `'`, which Qwen's tool prompts would show the model).
fn tojson(
    v: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<minijinja::Value> = kwargs.get("ensure_ascii")?;
    let _: Option<minijinja::Value> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let bad = |e: serde_json::Error| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    };
    let json = serde_json::to_value(&v).map_err(bad)?;
    let mut out = Vec::new();
    let r = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let f = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, f);
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PySeparators);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    r.map_err(bad)?;
    Ok(String::from_utf8(out).unwrap_or_default())
}

/// serde_json's compact output with Python's default separators.
struct PySeparators;

impl serde_json::ser::Formatter for PySeparators {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// GPT-2's byte-level alphabet backwards: the byte a token character
/// stands for (printable Latin-1 bytes are themselves; the others were
/// moved to U+0100 and up, in order).
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let c = c as u32;
    if c < 0x100 {
        return printable(c).then_some(c as u8);
    }
    // The n-th non-printable byte maps to U+0100 + n.
    let n = c - 0x100;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

/// The most template instructions one chat rendering may run: far above
/// what the real Qwen templates take for long conversations with tools
/// (thousands a message), far below a runaway loop's.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// Incremental detokenization: text is released once it decodes to whole
/// characters (a multi-byte character split across tokens waits for its end).
/// Each step decodes only a short window of ids (the ids since the last
/// release, plus the ones before them as context, as Hugging Face's
/// text-generation-inference does), so a long generation costs linear time,
/// not quadratic. The concatenated pieces equal the decode of all ids.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the context window.
    prefix: usize,
    /// End of the ids already released.
    read: usize,
}

impl StreamDecoder {
    /// A decoder with no ids.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one id; return the newly complete text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.release(tok, true)
    }

    /// The text of ids not yet released (an incomplete character at the end
    /// decodes lossily), for the end of a generation.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        self.release(tok, false)
    }

    /// Release the text of the ids past `read`, decoding only the window
    /// from `prefix`; with `hold`, nothing while it ends in a split character.
    fn release(&mut self, tok: &Tokenizer, hold: bool) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if hold && now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let piece = match now.strip_prefix(before.as_str()) {
            Some(p) => p.to_string(),
            // A decoder whose text for a window does not extend the shorter
            // window's (none of ours): fall back to decoding everything.
            None => {
                let all = tok.decode(&self.ids)?;
                let done = tok.decode(&self.ids[..self.read])?;
                all.get(done.len()..).unwrap_or("").to_string()
            }
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(piece)
    }
}

/// [`StreamDecoder`] bound to its tokenizer.
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    dec: StreamDecoder,
}

impl TextStream<'_> {
    /// Add one id; return the new text, if any.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.dec.push(self.tok, id)
    }

    /// The text still held back (see [`StreamDecoder::flush`]).
    pub fn flush(&mut self) -> Result<String> {
        self.dec.flush(self.tok)
    }
}
