//! The binary end to end: the README's main command, synth + inspect, and plain
//! errors (non-zero exit, no panic) on bad input.

use std::process::Command;

fn samesum(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_samesum"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn inspect_with_no_file_runs_on_the_builtin_model() {
    let (ok, out, err) = samesum(&["inspect"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("architecture:  qwen3moe") && out.contains("blk.1.ffn_down_exps.weight"),
        "{out}"
    );
}

#[test]
fn inspect_plans_tier_mode_for_a_vram_budget_and_refuses_one_too_small() {
    let (ok, out, err) = samesum(&["inspect", "--vram-budget", "2G"]);
    assert!(ok, "{err}");
    assert!(out.contains("tier plan (--vram-budget 2G)"), "{out}");
    assert!(out.contains("slots per layer"), "{out}");
    let (ok, out, err) = samesum(&["inspect", "--json", "--vram-budget", "2G"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let slots = v["tier_plan"]["slots_per_layer"].as_u64().unwrap();
    let experts = v["tier_plan"]["experts_per_layer"].as_u64().unwrap();
    assert!(slots >= v["tier_plan"]["experts_used"].as_u64().unwrap() && slots <= experts);
    // 2 GiB holds the tiny model whole: every expert gets a slot.
    assert_eq!(slots, experts);
    let (ok, _, err) = samesum(&["inspect", "--vram-budget", "1M"]);
    assert!(!ok, "a 1 MiB budget was accepted");
    assert!(
        err.contains("too small") && err.contains("trunk needs"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (ok, _, err) = samesum(&["inspect", "--vram-budget", "lots"]);
    assert!(!ok && err.contains("--vram-budget"), "{err}");
}

#[test]
fn inspect_plans_expert_parallelism_and_names_the_sizes_when_it_does_not_fit() {
    let (ok, out, err) = samesum(&["inspect", "--json", "--gpus", "3", "--vram-budget", "2G"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let p = &v["expert_parallel_plan"];
    assert_eq!(p["gpus"], 3);
    // The tiny model's 8 experts over 3 GPUs: 3, 3 and 2, contiguous.
    let slices: Vec<(u64, u64)> = p["experts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["first"].as_u64().unwrap(), e["end"].as_u64().unwrap()))
        .collect();
    assert_eq!(slices, vec![(0, 3), (3, 6), (6, 8)]);
    assert!(v["tier_plan"].is_null());
    let (ok, out, err) = samesum(&["inspect", "--gpus", "2", "--vram-budget", "2G"]);
    assert!(
        ok && out.contains("expert parallelism over 2 GPUs"),
        "{err}"
    );
    // Room for the trunk and the reserve, not for half the experts.
    let (ok, _, err) = samesum(&["inspect", "--gpus", "2", "--vram-budget", "1025M"]);
    assert!(!ok, "a plan that does not fit was accepted");
    assert!(
        err.contains("does not fit on 2 GPUs") && err.contains("bytes free"),
        "{err}"
    );
    let (ok, _, err) = samesum(&["inspect", "--gpus", "9", "--vram-budget", "8G"]);
    assert!(
        !ok && err.contains("cannot split 8 experts over 9"),
        "{err}"
    );
    let (ok, _, err) = samesum(&["inspect", "--gpus", "2"]);
    assert!(!ok && err.contains("--vram-budget"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_runs_each_test_at_each_context_depth() {
    let (ok, out, err) = samesum(&["bench", "-p", "8", "-n", "2", "-d", "0,16", "-r", "1"]);
    assert!(ok, "{err}");
    for test in ["| pp8 |", "| pp8 @ d16 |", "| tg2 |", "| tg2 @ d16 |"] {
        assert!(out.contains(test), "{test} missing:\n{out}");
    }
    // The build is named under the tables, as in --version.
    let build = out.lines().last().unwrap_or_default();
    let commit = build.strip_prefix("build: ").expect("a build line last");
    assert!(!commit.is_empty() && !commit.contains(' '), "{build}");
    let (ok, version, err) = samesum(&["--version"]);
    assert!(ok, "{err}");
    assert!(version.contains(&format!("({commit})")), "{version}");
}

#[test]
fn an_impossible_context_is_a_plain_error() {
    for args in [
        [
            "bench",
            "-p",
            "0",
            "-n",
            "1",
            "-d",
            "100000000000",
            "-r",
            "1",
        ],
        [
            "bench",
            "-p",
            "100000000000",
            "-n",
            "0",
            "-d",
            "0",
            "-r",
            "1",
        ],
    ] {
        let (ok, _, err) = samesum(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains("cannot allocate the KV cache"), "{err}");
        assert!(
            !err.contains("panicked") && !err.contains("memory allocation"),
            "{err}"
        );
    }
}

#[test]
fn synth_then_inspect_json() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("m.gguf");
    let f = f.to_str().unwrap();
    let (ok, _, err) = samesum(&[
        "synth",
        "--shape",
        "tiny-qwen35moe",
        "--quant",
        "q4_k",
        "--seed",
        "9",
        "-o",
        f,
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = samesum(&["inspect", "--json", f]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["architecture"], "qwen35moe");
    assert_eq!(v["tensor_count"], 76);
    assert_eq!(v["hparams"]["ssm.time_step_rank"], 4);
    assert_eq!(v["by_type"]["q6_K"]["tensors"], 1);
    // Refuses to overwrite without --force.
    let (ok, _, err) = samesum(&["synth", "--shape", "tiny-qwen35moe", "-o", f]);
    assert!(!ok && err.contains("--force"), "{err}");
}

#[test]
fn synth_writes_split_files_that_inspect_and_run_open_from_any_shard() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole.gguf");
    let whole = whole.to_str().unwrap();
    let split = dir.path().join("m.gguf");
    let split = split.to_str().unwrap();
    let base = ["synth", "--shape", "tiny-qwen35moe", "--quant", "q4_k"];
    let (ok, _, err) = samesum(&[&base[..], &["-o", whole]].concat());
    assert!(ok, "{err}");
    // 76 tensors at 26 a shard: three shards.
    let (ok, _, err) = samesum(&[&base[..], &["--split-max-tensors", "26", "-o", split]].concat());
    assert!(ok && err.contains("3 files"), "{err}");
    let shard = |i: usize| dir.path().join(format!("m-{i:05}-of-00003.gguf"));
    assert!(!dir.path().join("m.gguf").exists());
    let (ok, out, err) = samesum(&["inspect", shard(2).to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("split:         3 shards"), "{out}");
    let (ok, out, err) = samesum(&["inspect", "--json", shard(3).to_str().unwrap()]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["shards"].as_u64(), v["tensor_count"].as_u64()),
        (Some(3), Some(76))
    );
    // The same greedy text from the whole file and from the shards.
    let greedy = |m: &str| {
        let (ok, out, err) = samesum(&[
            "run",
            "-m",
            m,
            "-p",
            "hello there",
            "-n",
            "12",
            "--temp",
            "0",
        ]);
        assert!(ok, "{err}");
        out
    };
    assert_eq!(greedy(whole), greedy(shard(1).to_str().unwrap()));
    // Refuses to overwrite shards without --force; a missing shard is named.
    let (ok, _, err) = samesum(&[&base[..], &["--split-max-tensors", "40", "-o", split]].concat());
    assert!(
        !ok && err.contains("m-0000") && err.contains("--force"),
        "{err}"
    );
    std::fs::remove_file(shard(3)).unwrap();
    let (ok, _, err) = samesum(&["run", "-m", shard(1).to_str().unwrap(), "-n", "2"]);
    assert!(
        !ok && err.contains("m-00003-of-00003.gguf") && err.contains("missing"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_input_is_a_plain_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\0\0\0\xff\xff").unwrap();
    for args in [
        vec!["inspect", bad.to_str().unwrap()],
        vec!["inspect", "/nonexistent/file.gguf"],
        vec!["synth", "--shape", "nope", "-o", "/tmp/x.gguf"],
        vec!["synth", "--quant", "iq1_s", "-o", "/tmp/x.gguf"],
        vec!["synth", "--layers", "0", "-o", "/tmp/x.gguf"],
        vec!["bench-quant", "--row", "100"],
        vec!["bench-gemm", "--formats", "q9_9"],
        vec!["bench-gemm", "--shape", "nope"],
        vec!["bench-gemm", "-m", "0"],
        vec!["bench-gemm", "-m", "8,70000"],
    ] {
        let (ok, _, err) = samesum(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let (_, _, err) = samesum(&["inspect", bad.to_str().unwrap()]);
    assert!(err.contains("truncated") || err.contains("offset"), "{err}");
}

#[test]
fn bench_gemm_times_the_moe_block_of_each_format() {
    let (ok, out, err) = samesum(&[
        "bench-gemm",
        "--shape",
        "tiny-qwen3moe",
        "-m",
        "24,5",
        "-r",
        "1",
        "--formats",
        "q8_0,iq4_xs",
    ]);
    assert!(ok, "{err}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("| tiny-qwen3moe |"))
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    let want = [
        ("q8_0", "24"),
        ("q8_0", "5"),
        ("iq4_xs", "24"),
        ("iq4_xs", "5"),
    ];
    for (row, (name, m)) in rows.iter().zip(want) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!((cells[2], cells[3]), (name, m), "{row}");
        let ms: f64 = cells[5].parse().unwrap();
        assert!(ms > 0.0 && ms.is_finite(), "{row}");
    }
}

#[test]
fn run_with_no_model_generates_and_reports() {
    let (ok, _, err) = samesum(&["run", "-n", "8", "--temp", "0"]);
    assert!(ok, "{err}");
    assert!(
        err.contains("generation: ") && err.contains("tok/s"),
        "{err}"
    );
}

#[test]
fn run_is_deterministic_for_a_seed() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/conformance/fixtures/qwen3next.gguf"
    );
    let args = [
        "run",
        "-m",
        fixture,
        "--no-chat",
        "-p",
        "The quick brown fox",
        "-n",
        "12",
        "--seed",
        "4",
        "--temp",
        "1.0",
    ];
    let (ok1, out1, err1) = samesum(&args);
    let (ok2, out2, _) = samesum(&args);
    assert!(ok1 && ok2, "{err1}");
    assert_eq!(out1, out2);
    let (ok, _, err) = samesum(&["run", "-m", fixture, "--no-chat", "-c", "8", "-n", "100"]);
    assert!(!ok && err.contains("context"), "{err}");
}

#[test]
fn bench_prints_a_llama_bench_table() {
    let (ok, out, err) = samesum(&[
        "bench",
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "--prefill",
        "replay,batched",
    ]);
    assert!(ok, "{err}");
    for needle in ["| model |", "pp16 replay", "pp16 batched", "tg4", " ± "] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
}

#[test]
fn run_reads_a_prompt_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("p.txt");
    std::fs::write(&f, "The quick brown fox").unwrap();
    let (ok, _, err) = samesum(&[
        "run",
        "-f",
        f.to_str().unwrap(),
        "-n",
        "4",
        "--temp",
        "0",
        "--no-chat",
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = samesum(&["run", "-f", "/nonexistent/prompt.txt", "-n", "4"]);
    assert!(!ok && err.contains("prompt.txt"), "{err}");
}

#[test]
fn every_simd_level_generates_the_same_tokens() {
    // The kernels (quantized dots, delta rule, attention) are compiled for
    // several vector widths and chosen at run time; each must compute the same
    // bytes, so greedy generation must not change with SAMESUM_ISA.
    let dir = tempfile::tempdir().unwrap();
    let mut outs = Vec::new();
    for isa in ["scalar", "avx2", "avx512", "amx"] {
        for shape in ["tiny-qwen35moe", "tiny-qwen3moe"] {
            let f = dir.path().join(format!("{shape}.gguf"));
            if !f.exists() {
                let (ok, _, err) = samesum(&[
                    "synth",
                    "--shape",
                    shape,
                    "--quant",
                    "q4_k",
                    "-o",
                    f.to_str().unwrap(),
                ]);
                assert!(ok, "{err}");
            }
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_samesum"))
                .env("SAMESUM_ISA", isa)
                .args([
                    "run",
                    "-m",
                    f.to_str().unwrap(),
                    "--temp",
                    "0",
                    "-n",
                    "40",
                    "--no-chat",
                    "-p",
                    "The quick brown fox jumps over the lazy dog and keeps running",
                    "--chunk",
                    "5",
                ])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            outs.push((isa, shape, out.stdout));
        }
    }
    for (isa, shape, o) in &outs {
        let base = &outs
            .iter()
            .find(|x| x.0 == "scalar" && x.1 == *shape)
            .unwrap()
            .2;
        assert_eq!(o, base, "{shape}: {isa} generated other tokens than scalar");
    }
}

#[test]
fn a_missing_or_unknown_device_is_a_plain_error() {
    let (ok, _, err) = samesum(&["run", "-n", "2", "--device", "tpu"]);
    assert!(!ok);
    assert!(err.contains("--device") && err.contains("cuda"), "{err}");
    // On a machine without the CUDA driver the CUDA backend says so (and on a
    // machine with one, it runs).
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return;
    }
    let (ok, _, err) = samesum(&["run", "-n", "2", "--device", "cuda"]);
    assert!(!ok);
    assert!(
        err.contains("libcuda") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn shared_flags_reject_bad_values_in_every_command() {
    for cmd in ["run", "bench", "identity", "agree", "serve"] {
        for (args, flag) in [
            (&["--device", "tpu"][..], "--device"),
            (&["--kv-type", "q8"], "--kv-type"),
            (&["--vram-budget", "lots"], "--vram-budget"),
            (&["--vram-budget", "24G"], "--vram-budget"),
            (&["--attention", "fast"], "--attention"),
            (&["--chunk", "0"], "--chunk"),
            (&["-ngl", "many"], "--n-gpu-layers"),
            (&["-fa", "yes"], "--flash-attn"),
        ] {
            let mut all = vec![cmd];
            all.extend_from_slice(args);
            let (ok, _, err) = samesum(&all);
            assert!(!ok, "{all:?} succeeded");
            assert!(
                err.starts_with("error: ") && err.contains(flag) && !err.contains("panicked"),
                "{all:?}: {err}"
            );
        }
    }
}

#[test]
fn agree_passes_a_same_arm_control_and_fails_a_reordered_moe() {
    // The control: arm B is arm A, so every position agrees and the logits
    // are equal.
    let (ok, out, err) = samesum(&["agree", "--lens", "64,300", "--gen", "16", "-t", "2"]);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("| 300 | 16/16 | 100.00% | 16/16 | 0.000e0 | pass |"),
        "{out}"
    );
    // The MoE's top-k summed in reverse is another function: its logits
    // differ, and at 300 tokens an argmax moves, so a 100% bar fails.
    let (ok, out, err) = samesum(&[
        "agree",
        "--lens",
        "300",
        "--gen",
        "16",
        "-t",
        "2",
        "--bar",
        "1",
        "--variant",
        "reversed-topk",
    ]);
    assert!(!ok, "{out}");
    assert!(out.contains("FAIL"), "{out}");
    assert!(err.contains("below the 100.00% bar"), "{err}");
    // Prompts from a text file (repeated to each length).
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("p.txt");
    std::fs::write(&text, "The quick brown fox jumps over the lazy dog. ").unwrap();
    let t = text.to_str().unwrap();
    let (ok, out, err) = samesum(&[
        "agree", "--lens", "40,100", "--gen", "8", "-t", "2", "--text", t,
    ]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("| 100 | 8/8 | 100.00% | 8/8 |"), "{out}");
    // Bad arguments are plain errors.
    for args in [
        &["agree", "--text", "/no/such/file"][..],
        &["agree", "--gen", "0"],
        &["agree", "--lens", "0"],
        &["agree", "--bar", "2"],
        &["agree", "--variant", "sideways"],
        &["agree", "--probe", "sideways"],
        &["agree", "--seeds", "0"],
        &["agree", "--seeds", "2", "--text", t],
        &["agree", "--attention", "fast"],
    ] {
        let (ok, _, err) = samesum(args);
        assert!(!ok && err.starts_with("error: "), "{args:?}: {err}");
    }
}

#[test]
fn agree_holds_arm_b_to_a_probe_arm() {
    // The control against the reordered MoE as the probe: 16/16 against
    // 15/16 passes the probe bar (B may fall 5 points below the probe).
    let (ok, out, err) = samesum(&[
        "agree",
        "--lens",
        "300",
        "--gen",
        "16",
        "-t",
        "2",
        "--probe",
        "reversed-topk",
    ]);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("| 300 | 16/16 | 100.00% | 16/16 | 0.000e0 | pass | 1 | 15/16 |"),
        "{out}"
    );
    assert!(
        out.contains("probe bar: arm B 100.00% against the probe's 93.75% less 5 points: pass"),
        "{out}"
    );
    // The probe against itself with a margin of -1 point (B must beat the
    // probe by a point) fails: the bar can fail.
    let (ok, out, err) = samesum(&[
        "agree",
        "--lens",
        "300",
        "--gen",
        "16",
        "-t",
        "2",
        "--variant",
        "reversed-topk",
        "--probe",
        "reversed-topk",
        "--probe-margin",
        "-1",
    ]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("probe bar: arm B 93.75% against the probe's 93.75% less -1 points: FAIL"),
        "{out}"
    );
    assert!(err.contains("below the probe's"), "{err}");
    // Several random prompts per length, one row each.
    let (ok, out, err) = samesum(&[
        "agree", "--lens", "40", "--gen", "4", "-t", "2", "--seeds", "3", "--seed", "7",
    ]);
    assert!(ok, "{out}\n{err}");
    for seed in 7..10 {
        assert!(
            out.contains(&format!(
                "| 40 | 4/4 | 100.00% | 4/4 | 0.000e0 | pass | {seed} | - |"
            )),
            "{out}"
        );
    }
    assert!(out.contains("12 of 12 positions agree"), "{out}");
}

/// `samesum serve` outlives a streaming client that goes away mid-stream.
/// The binary restores SIGPIPE's default for its other commands (so that
/// `samesum inspect | head` ends quietly); a server that kept that default
/// would die on its next write to the closed socket (hyper writes with
/// writev, which raises SIGPIPE).
#[test]
fn serve_outlives_a_client_that_leaves_mid_stream() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_samesum"))
        .args(["serve", "--port", "0", "--max-batch", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("the server printed its address")
            .unwrap();
        if let Some(a) = line.strip_prefix("listening on http://") {
            break a.to_string();
        }
    };
    let request = |body: &str, path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let get = |path: &str| -> String {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    };
    // The server ignores SIGPIPE (a write to a socket whose client left
    // must be an error, not the end of the process): bit 13 of SigIgn.
    #[cfg(target_os = "linux")]
    {
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
        let ign = status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
            .unwrap();
        assert!(
            ign & (1 << (libc::SIGPIPE - 1)) != 0,
            "SIGPIPE not ignored: SigIgn {ign:x}"
        );
    }
    // Clients in turn: each reads the start of a long stream and leaves
    // with a reset (linger 0), so the server's next write fails. Whether
    // that write comes before the server reads the reset is a race, so
    // several clients.
    const CLIENTS: usize = 8;
    for _ in 0..CLIENTS {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let body = r#"{"prompt": "go", "max_tokens": 3000, "stream": true, "ignore_eos": true}"#;
        s.write_all(request(body, "/v1/completions").as_bytes())
            .unwrap();
        let mut buf = [0u8; 4096];
        // A signal delivered to this process may interrupt the read
        // (EINTR): that is no answer yet, so read again.
        let n = loop {
            match s.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r.unwrap(),
            }
        };
        let head = String::from_utf8_lossy(&buf[..n]);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        #[cfg(unix)]
        {
            use std::os::fd::AsRawFd;
            let linger = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: a valid socket and a linger struct of the size given.
            let rc = unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&linger as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as libc::socklen_t,
                )
            };
            assert_eq!(rc, 0);
        }
        drop(s);
        std::thread::sleep(Duration::from_millis(20));
    }
    // The server notices each departure, and keeps serving.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the server exited after a client left mid-stream"
        );
        let metrics = get("/metrics");
        let cancelled = metrics
            .lines()
            .find_map(|l| l.strip_prefix("samesum_requests_cancelled_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        if cancelled >= CLIENTS as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "cancelled {cancelled} of {CLIENTS}:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(get("/health").starts_with("HTTP/1.1 200"));
    assert!(child.try_wait().unwrap().is_none());
    child.kill().unwrap();
    child.wait().unwrap();
}

/// The number after `key` in `text` (e.g. "generation: " -> 12).
fn number_after(text: &str, key: &str) -> u64 {
    let i = text
        .find(key)
        .unwrap_or_else(|| panic!("{key:?} in {text}"))
        + key.len();
    let digits: String = text[i..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("a number after {key:?} in {text}"))
}

#[test]
fn run_n_minus_one_generates_to_the_end_of_the_context() {
    let base = [
        "run",
        "--no-chat",
        "-p",
        "The quick brown fox",
        "--temp",
        "0",
        "--verbose-prompt",
        "-c",
        "48",
    ];
    let mut args = base.to_vec();
    args.extend(["-n", "-1"]);
    let (ok, _, err) = samesum(&args);
    assert!(ok, "{err}");
    let prompt = number_after(&err, "prompt tokens (");
    let generated = number_after(&err, "generation: ");
    // Greedy on the built-in model meets no stop token before the end.
    assert_eq!(prompt + generated, 48, "{err}");
    // Other negative counts are errors that say what -1 means.
    let mut args = base.to_vec();
    args.extend(["-n", "-2"]);
    let (ok, _, err) = samesum(&args);
    assert!(!ok && err.contains("-1 means until"), "{err}");
    // A prompt that fills the context leaves nothing to generate.
    let (ok, _, err) = samesum(&["run", "--no-chat", "-c", "2", "-n", "-1"]);
    assert!(
        !ok && err.contains("no room") && err.contains("-c"),
        "{err}"
    );
}

#[test]
fn llama_cpp_gpu_layers_pick_the_device() {
    // -ngl 0 is the CPU; -ngl above 0 with --device cpu contradicts it, and
    // -ngl 0 with --device cuda too.
    let (ok, _, err) = samesum(&["run", "-n", "2", "--temp", "0", "-ngl", "0"]);
    assert!(ok && err.contains("backend: cpu"), "{err}");
    let (ok, _, err) = samesum(&["run", "-n", "2", "-ngl", "99", "--device", "cpu"]);
    assert!(
        !ok && err.contains("--n-gpu-layers 99 asks for the GPU"),
        "{err}"
    );
    let (ok, _, err) = samesum(&["run", "-n", "2", "--n-gpu-layers", "0", "--device", "cuda"]);
    assert!(
        !ok && err.contains("--n-gpu-layers 0 means the CPU"),
        "{err}"
    );
    let (ok, _, err) = samesum(&["run", "-n", "2", "-ngl", "lots"]);
    assert!(!ok && err.contains("--n-gpu-layers"), "{err}");
    // Without a CUDA device, -ngl above 0 says so and runs on the CPU.
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return;
    }
    for n in ["99", "all", "-1"] {
        let (ok, _, err) = samesum(&["run", "-n", "2", "--temp", "0", "-ngl", n]);
        assert!(ok, "{err}");
        assert!(
            err.contains("no CUDA device found; running on the CPU")
                && err.contains("backend: cpu"),
            "{err}"
        );
    }
}

#[test]
fn llama_cpp_flash_attn_is_accepted_with_a_note() {
    let (ok, out_default, err) = samesum(&["run", "-n", "6", "--temp", "0"]);
    assert!(ok, "{err}");
    assert!(!err.contains("-fa"), "{err}");
    for (value, note) in [
        ("on", "flash attention on CUDA's tensor cores"),
        ("off", "--attention exact for the f32 reference"),
    ] {
        let (ok, out, err) = samesum(&["run", "-n", "6", "--temp", "0", "-fa", value]);
        assert!(ok && err.contains(note), "-fa {value}: {err}");
        // It changes nothing: the same tokens as without it.
        assert_eq!(out, out_default, "-fa {value}");
    }
    let (ok, out, err) = samesum(&["run", "-n", "6", "--temp", "0", "--flash-attn", "auto"]);
    assert!(ok && !err.contains("note"), "{err}");
    assert_eq!(out, out_default);
    let (ok, _, err) = samesum(&["run", "-n", "2", "-fa", "yes"]);
    assert!(!ok && err.contains("--flash-attn"), "{err}");
}

#[test]
fn llama_cpp_ubatch_size_is_the_chunk() {
    let base = [
        "run",
        "-n",
        "8",
        "--temp",
        "0",
        "--no-chat",
        "-p",
        "The quick brown fox jumps",
    ];
    let (ok, out, err) = samesum(&base);
    assert!(ok, "{err}");
    for flag in ["-ub", "--ubatch-size", "--chunk"] {
        let (ok, o, err) = samesum(&[&base[..], &[flag, "3"]].concat());
        assert!(ok, "{flag}: {err}");
        // Any chunk computes the same tokens.
        assert_eq!(o, out, "{flag}");
        let (ok, _, err) = samesum(&[&base[..], &[flag, "0"]].concat());
        assert!(!ok && err.contains("--chunk"), "{flag}: {err}");
    }
}

#[test]
fn serve_takes_llama_cpp_parallel_as_max_batch() {
    for flag in ["-np", "--parallel", "--max-batch"] {
        let (ok, _, err) = samesum(&["serve", "--port", "0", flag, "0"]);
        assert!(!ok && err.contains("--max-batch"), "{flag}: {err}");
    }
    let (ok, out, _) = samesum(&["serve", "--help"]);
    assert!(ok && out.contains("--parallel"), "{out}");
}

#[test]
fn run_without_a_seed_draws_one_and_prints_it() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/conformance/fixtures/qwen3next.gguf"
    );
    let args = [
        "run",
        "-m",
        fixture,
        "--no-chat",
        "-p",
        "The quick brown fox",
        "-n",
        "12",
        "--temp",
        "1.0",
    ];
    let (ok, out, err) = samesum(&args);
    assert!(ok, "{err}");
    let seed = number_after(&err, "seed: ");
    let (ok, _, err2) = samesum(&[&args[..], &["--seed", "-1"]].concat());
    assert!(ok, "{err2}");
    assert_ne!(
        seed,
        number_after(&err2, "seed: "),
        "two random seeds alike"
    );
    // The printed seed repeats the run.
    let s = seed.to_string();
    let (ok, again, err) = samesum(&[&args[..], &["--seed", &s]].concat());
    assert!(ok, "{err}");
    assert_eq!(number_after(&err, "seed: "), seed);
    assert_eq!(again, out);
    let (ok, _, err) = samesum(&[&args[..], &["-s", "-2"]].concat());
    assert!(!ok && err.contains("--seed"), "{err}");
}

#[test]
fn out_of_range_values_are_warnings() {
    // -n 0: the warnings come before generation, which these values need not survive.
    for (args, warning) in [
        (&["--top-p", "1.5"][..], "--top-p 1.5 is outside (0, 1]"),
        (&["--top-p", "0"], "--top-p 0 is outside (0, 1]"),
        (&["--min-p", "-0.1"], "--min-p -0.1 is outside [0, 1]"),
        (&["--temp", "-1"], "--temp -1 is negative"),
        (&["--temp", "NaN"], "--temp is NaN"),
        (
            &["-c", "8192"],
            "-c 8192 is above the model's trained context of 4096",
        ),
    ] {
        let mut all = vec!["run", "-n", "0"];
        all.extend_from_slice(args);
        let (ok, _, err) = samesum(&all);
        assert!(ok, "{args:?}: {err}");
        assert!(
            err.contains(&format!("warning: {warning}")),
            "{args:?}: {err}"
        );
    }
    // -c 0 is the model's trained context.
    let (ok, _, err) = samesum(&["run", "-n", "2", "-c", "0", "--temp", "0"]);
    assert!(ok && err.contains("context: 4096 tokens (-c 0"), "{err}");
    let (ok, _, err) = samesum(&["serve", "-c", "0", "-np", "0"]);
    assert!(!ok && err.contains("context: 4096 tokens (-c 0"), "{err}");
    // The defaults warn about nothing.
    let (ok, _, err) = samesum(&["run", "-n", "0"]);
    assert!(ok && !err.contains("warning"), "{err}");
}

/// Ctrl-C during a prefill: `run` says how far the prompt got (no made-up
/// throughput for the whole prompt) and exits with 130, as a shell reports
/// a command stopped by SIGINT.
#[cfg(unix)]
#[test]
fn run_interrupted_during_the_prefill_reports_how_far_it_got_and_exits_130() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("p.txt");
    std::fs::write(
        &prompt,
        "the quick brown fox jumps over the lazy dog ".repeat(250),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_samesum"))
        .args([
            "run",
            "--no-chat",
            "--prefill",
            "replay",
            "-c",
            "8192",
            "-n",
            "4",
            "--temp",
            "0",
            "-t",
            "1",
            "-f",
        ])
        .arg(&prompt)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The backend line comes right before the prefill (of 6,002 tokens one
    // at a time: seconds); interrupt a moment after it.
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "ended early: {seen}");
        seen += &line;
        if line.starts_with("backend:") {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    seen += &rest;
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{seen}");
    let line = seen
        .lines()
        .find(|l| l.contains("[interrupted] prompt:"))
        .unwrap_or_else(|| panic!("no prefill report: {seen}"));
    // "prompt: N of M tokens": fewer fed than the prompt holds.
    let nums: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|t| t.parse().ok())
        .collect();
    assert!(nums.len() >= 2 && nums[0] < nums[1], "{line}");
}

/// `samesum bench-serve` against a running `samesum serve`: every request
/// answered with a prompt of exactly the asked tokens (tokenized by the
/// server), the generated tokens counted from the final usage (4 requests
/// of 8 tokens), the table printed; and a server that is not there is a
/// plain error.
#[test]
fn bench_serve_loads_a_running_server() {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_samesum"))
        .args(["serve", "--port", "0", "--max-batch", "4"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = loop {
        let line = lines
            .next()
            .expect("the server printed its address")
            .unwrap();
        if let Some(a) = line.strip_prefix("listening on ") {
            break a.trim().to_string();
        }
    };
    let (ok, out, err) = samesum(&[
        "bench-serve",
        "--url",
        &url,
        "--clients",
        "2",
        "--requests",
        "4",
        "--max-tokens",
        "8",
        "--prompt-tokens",
        "16",
    ]);
    // The prompts were token ids, 16 each: the server prefilled 4 x 16.
    let metrics = std::process::Command::new("curl")
        .args(["-s", &format!("{url}/metrics")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    assert!(ok, "{err}");
    let row = out.lines().last().unwrap_or("");
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    // | clients | requests | prompt | max | generated | tok/s | per-stream | p50 | p99 | wall | decode |
    assert_eq!(&cells[1..6], &["2", "4", "16", "8", "32"], "{out}");
    if !metrics.is_empty() {
        assert!(
            metrics.contains("samesum_prompt_tokens_total 64\n"),
            "{metrics}"
        );
    }
    let tps: f64 = cells[6].parse().unwrap();
    let wall: f64 = cells[10].parse().unwrap();
    let decode: f64 = cells[11].parse().unwrap();
    assert!(tps > 0.0 && wall > 0.0 && decode > 0.0, "{out}");
    let (ok, _, err) = samesum(&[
        "bench-serve",
        "--url",
        "http://127.0.0.1:1",
        "--requests",
        "1",
    ]);
    assert!(!ok && err.contains("127.0.0.1:1"), "{err}");
}

/// `--think off` and `--chat-template-kwargs` reach the chat template; a
/// template's own default holds without them; bad JSON is a plain error.
#[test]
fn run_passes_template_kwargs_and_think() {
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("t.jinja");
    std::fs::write(
        &tpl,
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}<|im_start|>assistant\n{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}",
    )
    .unwrap();
    let model = dir.path().join("m.gguf");
    let (ok, _, err) = samesum(&[
        "synth",
        "--shape",
        "tiny-qwen3moe",
        "--chat-template",
        tpl.to_str().unwrap(),
        "-o",
        model.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let m = model.to_str().unwrap();
    let prompt_of = |extra: &[&str]| {
        let mut args = vec!["run", "-m", m, "-p", "Hi", "-n", "1", "--verbose-prompt"];
        args.extend(extra);
        let (ok, _, err) = samesum(&args);
        assert!(ok, "{err}");
        err.lines()
            .find(|l| l.starts_with("prompt tokens"))
            .unwrap()
            .to_string()
    };
    let default = prompt_of(&[]);
    assert!(!default.contains("</think>"), "{default}");
    let off = prompt_of(&["--think", "off"]);
    assert!(off.contains("</think>"), "{off}");
    assert_eq!(
        prompt_of(&["--chat-template-kwargs", r#"{"enable_thinking": false}"#]),
        off
    );
    assert_eq!(prompt_of(&["--think", "on"]), default);
    let (ok, _, err) = samesum(&["run", "--chat-template-kwargs", "[1]"]);
    assert!(!ok && err.contains("JSON object"), "{err}");
}

/// `samesum ARGS` with `input` on stdin; `RUST_LOG=debug` so conversation
/// mode logs which way it prefilled.
fn samesum_stdin(args: &[&str], input: &str) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_samesum"))
        .args(args)
        .env("RUST_LOG", "debug")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn conversation_second_reply_equals_a_one_shot_run_on_the_rendered_conversation() {
    use samesum_engine::tokenizer::Tokenizer;
    let dir = tempfile::tempdir().unwrap();
    // The built-in model of `run` (tiny-qwen3next, q8_0, seed 0), kept in a
    // file so the test can render the conversation with its tokenizer.
    let m = dir.path().join("m.gguf");
    let m = m.to_str().unwrap();
    let (ok, _, err) = samesum(&["synth", "--shape", "tiny-qwen3next", "-o", m]);
    assert!(ok, "{err}");
    let tok =
        Tokenizer::from_metadata(samesum_gguf::GgufFile::open(m).unwrap().metadata()).unwrap();
    let (system, u1, u2) = ("be brief", "hello there", "and then?");
    let mut paths = Vec::new();
    // One token a reply: the reply's text tokenizes back to what was
    // generated, so turn two prefills only its new tokens onto the state.
    // Eight: random weights pick tokens that are not their text's own
    // tokenization, so turn two starts a fresh state. Both must give the
    // one-shot run's bytes.
    for n in ["1", "8"] {
        let cnv = [
            "run", "-m", m, "-cnv", "--temp", "0", "-n", n, "--system", system,
        ];
        let (ok, one_turn, err) = samesum_stdin(&cnv, &format!("{u1}\n"));
        assert!(ok, "{err}");
        let reply1 = one_turn.strip_suffix('\n').unwrap();
        // /exit ends the conversation: the third line is never answered.
        let (ok, two_turns, err) = samesum_stdin(&cnv, &format!("{u1}\n{u2}\n/exit\nmore\n"));
        assert!(ok, "{err}");
        let reply2 = two_turns
            .strip_prefix(&one_turn)
            .unwrap_or_else(|| panic!("turn one differs: {one_turn:?} vs {two_turns:?}"))
            .strip_suffix('\n')
            .unwrap();
        assert!(!reply2.contains('\n') || n == "8", "{two_turns:?}");
        paths.push((
            err.matches("extends the state").count(),
            err.matches("does not extend").count(),
        ));
        let rendered = tok
            .chat_messages(&[
                ("system", system),
                ("user", u1),
                ("assistant", reply1),
                ("user", u2),
            ])
            .unwrap();
        let (ok, one_shot, err) = samesum(&[
            "run",
            "-m",
            m,
            "--no-chat",
            "-p",
            &rendered,
            "--temp",
            "0",
            "-n",
            n,
        ]);
        assert!(ok, "{err}");
        assert!(!reply2.is_empty());
        assert_eq!(one_shot, format!("{reply2}\n"), "-n {n}");
    }
    assert_eq!(
        paths,
        [(2, 0), (1, 1)],
        "(extended, fresh) turns for -n 1 and -n 8"
    );
    // EOF ends it too; -cnv takes no prompt.
    let (ok, out, err) = samesum_stdin(&["run", "-m", m, "-cnv", "-n", "2"], "");
    assert!(ok && out.is_empty(), "{err}");
    let (ok, _, err) = samesum(&["run", "-m", m, "-cnv", "-p", "hi"]);
    assert!(!ok && err.contains("--prompt"), "{err}");
}

#[test]
fn perplexity_on_the_builtin_model_is_finite_reproducible_and_refuses_short_texts() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog,", "and",
    ];
    let body: Vec<&str> = (0..400usize)
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect();
    std::fs::write(&text, body.join(" ")).unwrap();
    let t = text.to_str().unwrap();
    let (ok, out, err) = samesum(&["perplexity", "-f", t, "-c", "64", "--chunks", "3"]);
    assert!(ok, "{err}");
    // llama-perplexity's shape: the running estimates, then the final line.
    let mut lines = out.lines();
    let running = lines.next().unwrap();
    let est: Vec<f64> = running
        .trim_end_matches(',')
        .split(',')
        .enumerate()
        .map(|(i, e)| {
            let (n, v) = e.split_once(']').unwrap();
            assert_eq!(n, format!("[{}", i + 1));
            v.parse().unwrap()
        })
        .collect();
    assert_eq!(est.len(), 3, "{out}");
    let last = lines.next().unwrap();
    let rest = last.strip_prefix("Final estimate: PPL = ").unwrap();
    let (ppl, se) = rest.split_once(" +/- ").unwrap();
    let (ppl, se): (f64, f64) = (ppl.parse().unwrap(), se.parse().unwrap());
    assert!(
        ppl.is_finite() && ppl > 1.0 && se.is_finite() && se > 0.0,
        "{out}"
    );
    assert_eq!(format!("{:.4}", est[2]), format!("{ppl:.4}"));
    let (ok, again, err) = samesum(&["perplexity", "-f", t, "-c", "64", "--chunks", "3"]);
    assert!(ok && again == out, "{err}\n{out}\n{again}");
    // JSON: the same numbers; a different chunk size of the forward, the same bytes.
    let (ok, js, err) = samesum(&[
        "perplexity",
        "-f",
        t,
        "-c",
        "64",
        "--chunks",
        "3",
        "--json",
        "--chunk",
        "5",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&js).unwrap();
    assert_eq!(v["scored"], 3 * 31);
    assert_eq!(
        format!("{:.4}", v["ppl"].as_f64().unwrap()),
        format!("{ppl:.4}")
    );
    assert_eq!(v["estimates"].as_array().unwrap().len(), 3);
    let json_with = |chunk: &str| {
        let (ok, js, err) = samesum(&[
            "perplexity",
            "-f",
            t,
            "-c",
            "64",
            "--chunks",
            "3",
            "--json",
            "--chunk",
            chunk,
        ]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&js).unwrap();
        (v["ppl"].clone(), v["estimates"].clone())
    };
    assert_eq!(json_with("1"), (v["ppl"].clone(), v["estimates"].clone()));
    // Shorter than two chunks: a plain error naming the counts.
    let (ok, _, err) = samesum(&["perplexity", "-f", t, "-c", "4096"]);
    assert!(!ok && err.contains("needs at least 8192"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (ok, _, err) = samesum(&["perplexity", "-f", "/nonexistent/text.txt"]);
    assert!(!ok && err.contains("/nonexistent/text.txt"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (ok, _, err) = samesum(&["perplexity", "-f", t, "-c", "2"]);
    assert!(!ok && err.contains("-c"), "{err}");
}
