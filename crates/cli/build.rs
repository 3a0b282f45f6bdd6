//! Names the build: the git commit the binary was built from (short hash),
//! or "unknown" outside a git checkout, for `--version` and the benchmark
//! tables (as llama-bench prints its build).

use std::process::Command;

fn main() {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        if !out.status.success() {
            return None;
        }
        let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
        (!s.is_empty()).then_some(s)
    };
    let commit = git(&["rev-parse", "--short=7", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=BUILD_COMMIT={commit}");
    // A new commit (or checkout) moves HEAD or the ref it names. Only
    // files that exist are watched: cargo reruns the script on every build
    // for a watched path that is missing.
    let watch = |p: std::path::PathBuf| {
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    };
    if let Some(dir) = git(&["rev-parse", "--git-dir"]).map(std::path::PathBuf::from) {
        watch(dir.join("HEAD"));
        let common = git(&["rev-parse", "--git-common-dir"])
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| dir.clone());
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch(dir.join(&r));
            watch(common.join(&r));
        }
        watch(common.join("packed-refs"));
    }
    println!("cargo:rerun-if-changed=build.rs");
}
