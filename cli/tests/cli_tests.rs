//! The `ragged` binary, end to end: plans written as JSON pass the independent checker
//! `tools/check_plan.py`; bad input exits non-zero with a message instead of panicking.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The workspace root (this crate lives in `cli/`): `models/`, `tools/` and `docs/` are there.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ has a parent")
}

fn ragged(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ragged"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run ragged")
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    dir.join(name)
}

/// Runs the independent checker; with a block spec it recomputes every block from the shape.
fn check_plan(plan: &PathBuf, model: &str, world: usize, block: Option<&str>) -> (bool, String) {
    let mut cmd = Command::new("python3");
    cmd.arg("tools/check_plan.py")
        .arg(plan)
        .arg(format!("models/{model}.json"))
        .arg(world.to_string());
    if let Some(block) = block {
        cmd.args(["--block", block, "--coll-align", "64"]);
    }
    let out = cmd
        .current_dir(root())
        .output()
        .expect("python3 runs tools/check_plan.py");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    (out.status.success(), text)
}

#[test]
fn json_plans_pass_the_independent_checker() {
    // Multi-buffer units included: Mixtral at V = 1024 puts its w2 tensors in their own buffer.
    let cases = [
        ("llama3_8b", 64, "rows:16"),
        ("gpt_oss_20b", 24, "tile:32x32"),
        ("gpt_oss_20b", 7, "matrix"),
        ("llama3_70b", 1000, "rows:1"),
        ("mixtral_8x7b", 1024, "rows:16"),
        ("deepseek_v3_671b", 256, "tile:32x32"),
    ];
    for (model, world, block) in cases {
        let path = tmp(&format!("{model}-{world}.json"));
        let out = ragged(&[
            "plan",
            "--model",
            &format!("models/{model}.json"),
            "--devices",
            &world.to_string(),
            "--block",
            block,
            "--json",
            path.to_str().unwrap(),
            "--full-units",
            "--no-baselines",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (ok, report) = check_plan(&path, model, world, Some(block));
        assert!(ok, "{model} V={world} {block}: {report}");
        assert!(report.starts_with("ok"), "{report}");
        let text = std::fs::read_to_string(&path).unwrap();
        let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
        let k_max = plan["units"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u["buffers"].as_array().unwrap().len())
            .max()
            .unwrap();
        if model == "mixtral_8x7b" {
            assert!(k_max > 1, "Mixtral at V=1024 kept one buffer per unit");
        }
    }
}

#[test]
fn checker_rejects_a_corrupted_plan() {
    // Guards the test above: the checker must be able to fail on our format.
    let path = tmp("corrupt.json");
    let out = ragged(&[
        "plan",
        "--model",
        "llama3_8b",
        "--devices",
        "16",
        "--block",
        "rows:1",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let text = std::fs::read_to_string(&path).unwrap();
    let mut plan: serde_json::Value = serde_json::from_str(&text).unwrap();
    let t = &mut plan["units"][1]["buffers"][0]["tensors"][1];
    let off = t["offset"].as_u64().unwrap();
    t["offset"] = (off + 1).into();
    std::fs::write(&path, serde_json::to_string(&plan).unwrap()).unwrap();
    let (ok, report) = check_plan(&path, "llama3_8b", 16, Some("rows:1"));
    assert!(!ok, "corrupted plan accepted: {report}");
}

#[test]
fn summary_lists_every_baseline_and_svg_is_drawn() {
    let svg = tmp("layer.svg");
    let out = ragged(&[
        "plan",
        "--model",
        "gpt_oss_20b",
        "--devices",
        "64",
        "--block",
        "rows:16",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for name in [
        "ragged",
        "FSDP2",
        "Megatron-FSDP",
        "FSDP1",
        "ZeRO-3",
        "plan time",
    ] {
        assert!(text.contains(name), "summary lacks {name}:\n{text}");
    }
    let drawing = std::fs::read_to_string(&svg).unwrap();
    assert!(drawing.starts_with("<svg") && drawing.contains("layers.0.mlp.experts.gate_up_proj"));
}

#[test]
fn bad_input_exits_with_a_message() {
    let cases: [&[&str]; 8] = [
        &["plan", "--model", "no_such_model", "--devices", "8"],
        &[
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "18446744073709551615",
        ],
        &[
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "8",
            "--max-buffers",
            "0",
        ],
        &[
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "8",
            "--layers-per-unit",
            "0",
        ],
        &["plan", "--model", "llama3_8b", "--devices", "0"],
        &[
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "8",
            "--block",
            "rows:0",
        ],
        &[
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "8",
            "--block",
            "tile:32x48",
        ],
        &["plan", "--model", "Cargo.toml", "--devices", "8"],
    ];
    for args in cases {
        let out = ragged(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(err.contains("error"), "{args:?}: no message: {err}");
    }
}

/// Planner options out of range: the message names the option and its value (no `Debug`
/// dump of the options struct), after the same "error:" as every other refusal.
#[test]
fn plan_options_out_of_range_name_the_option_and_value() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["--devices", "8", "--coll-align", "2097152"],
            "bad input coll_align 2097152: ",
        ),
        (
            &["--devices", "8", "--start-align", "3"],
            "bad input start_align 3: ",
        ),
        // 2^57 ranks: each shard fits, the model's buffers together do not.
        (
            &["--devices", "144115188075855872"],
            "at 144115188075855872 shards each, overflow",
        ),
    ];
    for (flags, want) in cases {
        let mut args = vec!["plan", "--model", "llama3_8b"];
        args.extend_from_slice(flags);
        let out = ragged(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            err.starts_with("error: ") && err.contains(want),
            "{args:?}: {err}"
        );
        assert!(!err.contains(" { "), "{args:?}: a Debug struct: {err}");
    }
}

/// `bench plan` without `--models` finds the repository's models from any working directory.
#[test]
fn bench_plan_finds_its_default_models_outside_the_repository_root() {
    let elsewhere = tmp("bench-plan-elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let args = [
        "bench",
        "plan",
        "--worlds",
        "8",
        "--blocks",
        "rows:16",
        "--repeats",
        "1",
        "--no-write",
    ];
    let out = Command::new(env!("CARGO_BIN_EXE_ragged"))
        .args(args)
        .current_dir(&elsewhere)
        .output()
        .expect("run ragged");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("| Meta-Llama-3-8B | 8 | rows:16 |"), "{text}");
}

/// A tensor of `2^63 − 1` elements (from the fuzz tests): on one rank, with one buffer or up to
/// three, `ragged plan` exits with a message naming the overflow, never a panic.
#[test]
fn plan_of_a_tensor_near_usize_max_exits_with_a_message() {
    let model = tmp("huge_tensor.json");
    std::fs::write(
        &model,
        r#"{"params":[{"name":"a0","shape":[9223372036854775807]}]}"#,
    )
    .unwrap();
    let model = model.to_str().unwrap();
    for extra in [&[][..], &["--max-buffers", "1"], &["--max-buffers", "3"]] {
        for devices in ["1", "18446744073709551615"] {
            let mut args = vec![
                "plan",
                "--model",
                model,
                "--devices",
                devices,
                "--block",
                "rows:1",
            ];
            args.extend_from_slice(extra);
            let out = ragged(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{args:?} succeeded");
            assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
            assert!(err.contains("overflow"), "{args:?}: {err}");
        }
    }
}

#[test]
fn bench_optim_prints_a_full_table_for_every_optimizer_and_shape_set() {
    let out = ragged(&["bench", "optim", "--quick", "--reps", "1", "--no-write"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Peak: f32: "), "no peak derivation:\n{text}");
    assert!(text.contains("memcpy") && text.contains("GEMM"), "{text}");
    let header = text
        .lines()
        .find(|l| l.starts_with("| optimizer |"))
        .unwrap_or_else(|| panic!("no table header:\n{text}"));
    let columns = header.matches('|').count() - 1;
    assert_eq!(columns, ragged_optimizers::bench::COLUMNS.len(), "{header}");
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| {
            ragged_optimizers::bench::OptimKind::ALL
                .iter()
                .any(|k| l.starts_with(&format!("| {} |", k.name())))
        })
        .collect();
    // Five optimizers × (one layer + two squares) in quick mode, and the Llama-style stack
    // for Muon in f32 and bf16.
    assert_eq!(rows.len(), 17, "{text}");
    assert_eq!(
        rows.iter().filter(|r| r.contains("(28 matrices)")).count(),
        2,
        "{text}"
    );
    for row in &rows {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), columns, "{row}");
        // Times, FLOPs, bytes and rates are numbers; times, FLOPs and bytes are positive.
        for k in [2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14] {
            let x: f64 = cells[k]
                .parse()
                .unwrap_or_else(|_| panic!("cell {k} of {row}"));
            assert!(x >= 0.0, "cell {k} of {row}");
            if [2, 4, 5, 10].contains(&k) {
                assert!(x > 0.0, "cell {k} of {row}");
            }
        }
    }
    // One progress line per case on stderr.
    assert_eq!(
        err.lines().filter(|l| l.starts_with('[')).count(),
        17,
        "{err}"
    );
}

#[test]
fn bench_optim_only_runs_one_optimizer_and_rejects_unknown_ones() {
    let out = ragged(&[
        "bench",
        "optim",
        "--quick",
        "--reps",
        "1",
        "--no-write",
        "--only",
        "adamw",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("| adamw |") && !text.contains("| muon |"),
        "{text}"
    );
    let out = ragged(&["bench", "optim", "--only", "sgd", "--no-write"]);
    assert!(!out.status.success());
}

#[test]
fn bench_optim_on_cuda_without_a_gpu_build_or_device_fails_with_the_reason() {
    let out = ragged(&[
        "bench",
        "optim",
        "--device",
        "cuda",
        "--quick",
        "--no-write",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // A `cuda` build on a GPU machine: the table names the device and both baselines.
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("cuBLAS GEMM") && text.contains("device memcpy"),
            "{text}"
        );
        return;
    }
    assert!(err.contains("CUDA unavailable"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The hostile inputs of issue 14: each ends with a `Display` sentence saying why (no panic,
/// no abort on a huge allocation, no `Debug` struct), before anything runs.
#[test]
fn hostile_bench_inputs_are_refused_with_the_reason() {
    let cases: [(&[&str], &str); 12] = [
        (
            &["bench", "comm", "--shard", "4000000000", "--out", "-"],
            "available",
        ),
        (
            &["bench", "comm", "--worlds", "0", "--out", "-"],
            "--worlds 0",
        ),
        (
            &["bench", "comm", "--worlds", "1", "--out", "-"],
            "at least 2 ranks",
        ),
        (
            &["bench", "comm", "--shard", "0", "--out", "-"],
            "1 element per rank",
        ),
        (
            &["bench", "comm", "--repeats", "0", "--out", "-"],
            "--repeats 0",
        ),
        (
            &["bench", "comm", "--train-ranks", "0", "--out", "-"],
            "--train-ranks 0",
        ),
        (
            &["bench", "train", "--only", "nothing", "--out", "-"],
            "--only \"nothing\" matches no variant",
        ),
        (
            &[
                "bench", "train", "--paired", "--only", "nothing", "--out", "-",
            ],
            "--only \"nothing\" matches no variant",
        ),
        (&["bench", "optim", "--ghz", "-1", "--no-write"], "--ghz -1"),
        (&["bench", "optim", "--ghz", "0", "--no-write"], "--ghz 0"),
        (
            &["bench", "optim", "--ghz", "nan", "--no-write"],
            "--ghz NaN",
        ),
        (
            &["bench", "optim", "--ghz", "inf", "--no-write"],
            "--ghz inf",
        ),
    ];
    for (args, want) in cases {
        let out = ragged(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
        assert!(!err.contains(" { "), "{args:?}: a Debug struct: {err}");
    }
}

/// Asserts that a quick `bench comm` (its table has an `all-gather` row) failed with `want` in
/// its message before the bench ran (no table printed); returns the message.
fn refused_before_the_bench(out: &Output, want: &str) -> String {
    let (stdout, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(!out.status.success(), "succeeded: {stdout}");
    assert!(err.contains(want), "{err:?} lacks {want:?}");
    assert!(
        !stdout.contains("all-gather"),
        "the bench ran first: {stdout}"
    );
    err
}

/// A `bench comm` of one small all-gather and reduce-scatter per world, no training: quick.
const QUICK_COMM: [&str; 10] = [
    "bench",
    "comm",
    "--worlds",
    "2",
    "--shard",
    "1024",
    "--repeats",
    "1",
    "--train-steps",
    "0",
];

#[test]
fn bench_comm_without_training_steps_prints_the_collectives_only() {
    // Every bench takes `--no-write` (as `--out -`): the table on stdout, the file untouched;
    // without it the file gets the bench's section.
    let md = tmp("bench-comm.md");
    let _ = std::fs::remove_file(&md);
    let md_arg = md.to_str().unwrap();
    let args = |write: bool| {
        let mut a = QUICK_COMM.to_vec();
        a.extend(["--out", md_arg]);
        if !write {
            a.push("--no-write");
        }
        a
    };
    let out = ragged(&args(false));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    // 2·(2−1)·1024·4 bytes, one row per collective, and no training table.
    assert!(stdout.contains("| all-gather | 2 | 8192 |"), "{stdout}");
    assert!(stdout.contains("| reduce-scatter | 2 | 8192 |"), "{stdout}");
    assert!(!stdout.contains("Training step"), "{stdout}");
    assert!(!md.exists(), "--no-write wrote {}", md.display());
    let out = ragged(&args(true));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read_to_string(&md).unwrap();
    assert!(written.contains("<!-- bench:comm -->"), "{written}");
    assert!(written.contains("| all-gather | 2 | 8192 |"), "{written}");
}

/// The markdown file is checked before a bench runs (a table is not lost at the end of a long
/// run to an unwritable path), and updated whole: the other sections kept, a link's target
/// written, no temporary file left.
#[test]
fn bench_output_is_checked_before_running_and_updated_whole() {
    let dir = tmp("bench-output");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let run = |cwd: &Path, out: Option<&Path>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ragged"));
        cmd.args(QUICK_COMM).current_dir(cwd);
        if let Some(out) = out {
            cmd.arg("--out").arg(out);
        }
        cmd.output().expect("run ragged")
    };
    let refused = |out: Output, want: &str| drop(refused_before_the_bench(&out, want));
    // The default, docs/benchmarks.md, from a folder without docs/.
    refused(run(&dir, None), "the folder docs does not exist");
    let read_only = dir.join("read-only.md");
    std::fs::write(&read_only, "# kept\n").unwrap();
    let mut perms = std::fs::metadata(&read_only).unwrap().permissions();
    perms.set_readonly(true);
    std::fs::set_permissions(&read_only, perms).unwrap();
    refused(run(&dir, Some(&read_only)), "read-only");
    assert_eq!(std::fs::read_to_string(&read_only).unwrap(), "# kept\n");

    let target = dir.join("target.md");
    let text = "# Mine\n\n<!-- bench:plan -->\nold plan\n<!-- /bench:plan -->\n\nnotes\n";
    std::fs::write(&target, text).unwrap();
    let link = dir.join("link.md");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let out = run(&dir, Some(&link));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    let written = std::fs::read_to_string(&target).unwrap();
    for kept in [
        "# Mine",
        "old plan",
        "notes",
        "<!-- bench:comm -->",
        "| all-gather | 2 |",
    ] {
        assert!(written.contains(kept), "{kept:?} missing: {written}");
    }
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");
}

#[test]
fn svg_draws_every_buffer_of_a_multi_buffer_unit() {
    let svg = tmp("mixtral-layer.svg");
    let out = ragged(&[
        "plan",
        "--model",
        "models/mixtral_8x7b.json",
        "--devices",
        "1024",
        "--block",
        "rows:16",
        "--no-baselines",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("k-buffer floor") && text.contains("k=2"),
        "{text}"
    );
    let drawing = std::fs::read_to_string(&svg).unwrap();
    // One nested picture per buffer, each titled with its buffer's name.
    assert_eq!(drawing.matches("<svg y=").count(), 2, "{drawing:.400}");
    for name in [
        "unit layers.0#0",
        "unit layers.0#1",
        "experts.0.w2.weight",
        "q_proj",
    ] {
        assert!(drawing.contains(name), "drawing lacks {name}");
    }
}

#[test]
fn validate_passes_a_small_preset_and_fails_bad_input() {
    let out = ragged(&[
        "validate",
        "--model",
        "llama3_8b",
        "--optimizer",
        "adam8bit",
        "--scale",
        "32",
        "--units",
        "2",
        "--worlds",
        "1,2,3",
        "--steps",
        "2",
        "--mesh-invariance",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(" 0 breaches of the numerics contract"),
        "{text}"
    );
    assert!(
        text.contains("model.layers.0.mlp.down_proj.weight"),
        "{text}"
    );
    assert!(
        text.contains("same bits") && !text.contains("DIFFERENT"),
        "{text}"
    );
    // Shampoo against its f64 reference, on the root unit (whose embedding tail block and 1-D
    // norm have rank-deficient factors: the case the reference's ε is chosen for).
    let out = ragged(&[
        "validate",
        "--model",
        "llama3_8b",
        "--optimizer",
        "shampoo",
        "--scale",
        "128",
        "--units",
        "1",
        "--worlds",
        "2",
        "--layouts",
        "ragged",
        "--steps",
        "2",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = text
        .split("against the f64 reference")
        .nth(1)
        .unwrap_or_else(|| panic!("no f64 reference: {text}"));
    for name in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        let line = reference
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} not checked: {text}"));
        assert!(line.ends_with("yes"), "{line}");
    }
    assert!(
        text.contains(" 0 breaches of the numerics contract"),
        "{text}"
    );
    for bad in [
        &[
            "validate",
            "--model",
            "llama3_8b",
            "--optimizer",
            "adamw",
            "--worlds",
            "0",
        ][..],
        &[
            "validate",
            "--model",
            "no_such_model",
            "--optimizer",
            "adamw",
        ],
        &["validate", "--model", "llama3_8b", "--optimizer", "sgd"],
    ] {
        let out = ragged(bad);
        assert!(!out.status.success(), "{bad:?} succeeded");
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("panicked"),
            "{bad:?} panicked"
        );
        // Refused before any work: no run header.
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(!said.contains("steps"), "{bad:?} started: {said}");
    }
}

/// `bench checkpoint --dir` works in a new or empty folder and leaves it as it found it; a
/// folder with anything in it is refused and nothing in it is touched.
#[test]
fn bench_checkpoint_never_deletes_files_it_did_not_write() {
    let root = tmp("bench-ckpt-dir");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let args = |dir: &std::path::Path| {
        let d = dir.to_str().unwrap().to_string();
        let list = [
            "bench",
            "checkpoint",
            "--worlds",
            "1",
            "--layers",
            "1",
            "--width",
            "32",
        ];
        let mut v: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        v.extend(["--hidden", "64", "--repeats", "1", "--out", "-", "--dir"].map(String::from));
        v.push(d);
        v
    };
    let run = |dir: &std::path::Path| {
        let a = args(dir);
        ragged(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let keep = root.join("keep.txt");
    std::fs::write(&keep, b"mine").unwrap();
    let out = run(&root);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not empty"), "{err}");
    assert_eq!(std::fs::read(&keep).unwrap(), b"mine");
    let empty = root.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = run(&empty);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_dir(&empty).unwrap().count(),
        0,
        "left files behind"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// Counts of one read "1 rank", "1 file", not "1 ranks" (a 1-rank checkpoint in the tests).
#[test]
fn checkpoint_info_and_verify_count_in_the_singular() {
    let one_rank = "tests/data/muon-v-for-every-matrix";
    let out = ragged(&["checkpoint", "info", one_rank]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("  1 rank, ") && text.contains("  1 rank file, "),
        "{text}"
    );
    let out = ragged(&["checkpoint", "verify", one_rank]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(": 1 file, "), "{text}");
}

/// `ragged checkpoint info|verify|export` on a checkpoint 3 thread ranks saved: info names it,
/// verify passes and then fails on a flipped byte (naming the file), export writes the
/// parameters bitwise with the model's names and shapes.
#[test]
fn checkpoint_info_verify_and_export_work_without_a_training_world() {
    use ragged::checkpoint::safetensors::Reader;
    use ragged::checkpoint::SaveOptions;
    use ragged::comm::threads::ThreadWorld;
    use ragged::demo::TransformerConfig;
    use ragged::fsdp::{fully_shard, FsdpOptions};
    use ragged_optimizers::{AdamW, AdamWConfig};

    let root = tmp("checkpoint-cli");
    let _ = std::fs::remove_dir_all(&root);
    let cfg = TransformerConfig::TINY;
    let params = cfg.init_params(1).unwrap();
    let (full, run) = ThreadWorld::run(3, |c| {
        let adamw = AdamW::new(AdamWConfig::default())?;
        let mut m = fully_shard(&params, adamw, c, FsdpOptions::default())?;
        m.save(&root, &SaveOptions::default())?;
        Ok((m.full_params()?, m.run_id().to_string()))
    })
    .unwrap()
    .remove(0);
    let dir = root.to_str().unwrap();
    let out = ragged(&["checkpoint", "info", dir]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("3 ranks") && text.contains("adamw"), "{text}");
    assert!(text.contains(&format!("run: {run}")), "{text}");
    // The recorded settings, a field a line.
    let default = AdamWConfig::default();
    for line in [
        format!("\n    lr = {:?}\n", default.lr),
        format!("\n    roles.matrix.lr_scale = {:?}\n", 1.0f64),
        "\n    mixed_precision.param_dtype = F32\n".to_string(),
    ] {
        assert!(text.contains(&line), "{line:?} in {text}");
    }
    assert!(ragged(&["checkpoint", "verify", dir]).status.success());

    let exported = root.join("model.safetensors");
    let out = ragged(&["checkpoint", "export", dir, exported.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Into the checkpoint's own folder (over a rank file): refused, and the checkpoint stays.
    let rank0 = root.join("step-00000000/rank-00000-of-00003.safetensors");
    let out = ragged(&["checkpoint", "export", dir, rank0.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("inside or named as the checkpoint folder"),
        "{err}"
    );
    assert!(ragged(&["checkpoint", "verify", dir]).status.success());
    // The exported file is a model `plan` and `validate` take by its header.
    let model = exported.to_str().unwrap();
    let out = ragged(&["plan", "--model", model, "--devices", "3"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("{} tensors", cfg.param_shapes().len())),
        "{text}"
    );
    let args = [
        "validate",
        "--model",
        model,
        "--optimizer",
        "adamw",
        "--worlds",
        "1,2",
        "--steps",
        "1",
    ];
    let out = ragged(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A safetensors file of integer buffers only is nothing to plan.
    let ints = root.join("ints.safetensors");
    let header = br#"{"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 16]);
    std::fs::write(&ints, bytes).unwrap();
    let out = ragged(&["plan", "--model", ints.to_str().unwrap(), "--devices", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no floating-point tensors"),
        "{err}"
    );
    let mut file = Reader::open(&exported, None).unwrap();
    for (name, shape) in cfg.param_shapes() {
        let info = file.tensor(&name).unwrap().clone();
        assert_eq!(info.shape, shape, "{name}");
        let mut bytes = vec![0u8; (info.bytes.end - info.bytes.start) as usize];
        file.read_tensor(&name, 0..bytes.len() as u64, &mut bytes)
            .unwrap();
        let want: Vec<u8> = full[&name].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(bytes == want, "{name}: exported values differ");
    }

    let rank2 = root.join("step-00000000/rank-00002-of-00003.safetensors");
    let mut b = std::fs::read(&rank2).unwrap();
    let i = b.len() / 2;
    b[i] ^= 1;
    std::fs::write(&rank2, b).unwrap();
    let out = ragged(&["checkpoint", "verify", dir]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("rank-00002-of-00003.safetensors") && err.contains("checksum"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// "1.16 GB" or "24.11 MB" as bytes.
fn size_bytes(text: &str) -> f64 {
    let (value, unit) = text.trim().split_once(' ').expect("a value and a unit");
    let scale = match unit {
        "GB" => 1e9,
        "MB" => 1e6,
        other => panic!("unit {other:?}"),
    };
    value.parse::<f64>().expect("a number") * scale
}

/// `plan --muon` lays out every unit of an MoE model (root and 48 layers of 128 experts) as
/// Muon's Auto layout does: every unit is on one of the report's lines, and Auto puts no more
/// bytes on the wire than keeping every matrix whole or splitting every one (and fewer than
/// all-whole here, where whole expert matrices force padding).
#[test]
fn plan_muon_reports_every_unit_and_auto_costs_no_more_than_either_end() {
    // 48 decoder layers and the root unit; two layers per unit: 24 and the root.
    for (layers, want_units) in [("1", 49), ("2", 25)] {
        let out = ragged(&[
            "plan",
            "--model",
            "models/qwen3_30b_a3b.json",
            "--devices",
            "8",
            "--no-baselines",
            "--muon",
            "--layers-per-unit",
            layers,
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (_, rest) = text
            .split_once("muon (Auto layout, V = 8")
            .unwrap_or_else(|| panic!("no muon section in {text}"));
        let first = rest.lines().next().unwrap();
        let wire = first.split_once("split; ").unwrap().1;
        let (auto, ends) = wire
            .split_once(" on the wire per step (all whole ")
            .unwrap();
        let (whole, split) = ends
            .trim_end_matches(')')
            .split_once(", all split ")
            .unwrap();
        let (auto, whole, split) = (size_bytes(auto), size_bytes(whole), size_bytes(split));
        assert!(auto <= whole && auto <= split, "{first}");
        assert!(auto < whole, "{first}");
        let units: usize = rest
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .map(|l| match l.split_once(" (") {
                Some((_, n)) if l.contains(" .. ") => n.split(')').next().unwrap().parse().unwrap(),
                _ => 1,
            })
            .sum();
        assert_eq!(units, want_units, "--layers-per-unit {layers}: {rest}");
    }
}

/// Runs `ragged` with `args` in the repository root and its stdout on `stdout`.
fn ragged_to(args: &[&str], stdout: impl Into<std::process::Stdio>) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ragged"))
        .args(args)
        .current_dir(root())
        .stdout(stdout)
        .output()
        .expect("run ragged")
}

/// A bench's argument list: `QUICK_COMM` writing into `out`.
fn quick_comm_into(out: &Path) -> Vec<&str> {
    let mut args = QUICK_COMM.to_vec();
    args.extend(["--out", out.to_str().unwrap()]);
    args
}

/// `--out` that is not a regular file once links are followed (a folder, a FIFO that would
/// block, a device that would be read without end) is refused, naming `--out` and the path,
/// before the bench runs.
#[test]
fn bench_out_that_is_not_a_regular_file_is_refused_before_running() {
    let dir = tmp("bench-out-not-regular");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("folder.md")).unwrap();
    let fifo = dir.join("fifo.md");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let link = dir.join("link.md");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    for out in [dir.join("folder.md"), fifo, link] {
        let want = format!("--out {}: is not a regular file", out.display());
        refused_before_the_bench(&ragged(&quick_comm_into(&out)), &want);
    }
}

/// Section markers out of order, repeated or alone are refused before the bench runs, naming
/// the file and the marker, and the file is left as it was (it used to get one more section
/// on every run).
#[test]
fn bench_out_with_bad_section_markers_is_refused_and_kept() {
    let dir = tmp("bench-out-markers");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (open, close) = ("<!-- bench:comm -->", "<!-- /bench:comm -->");
    let cases = [
        (format!("{close}\nold\n{open}\n"), "comes before"),
        (
            format!("{open}\na\n{close}\n{open}\nb\n{close}\n"),
            "appears 2 times",
        ),
        (format!("# Mine\n{open}\nold\n"), "has no"),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let md = dir.join(format!("case{i}.md"));
        std::fs::write(&md, text).unwrap();
        let out = ragged(&quick_comm_into(&md));
        let err = refused_before_the_bench(&out, &format!("--out {}", md.display()));
        assert!(err.contains(want), "case {i}: {err}");
        assert!(err.contains("bench:comm -->"), "no marker named: {err}");
        assert_eq!(&std::fs::read_to_string(&md).unwrap(), text);
    }
    // Another bench's section, or markers in order, do not stand in the way.
    let md = dir.join("fine.md");
    std::fs::write(&md, format!("<!-- /bench:plan -->\n{open}\nold\n{close}\n")).unwrap();
    let out = ragged(&quick_comm_into(&md));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read_to_string(&md).unwrap();
    assert_eq!(written.matches(open).count(), 1, "{written}");
    assert!(!written.contains("old"), "{written}");
}

/// A bench whose stdout reader is gone (`ragged bench … | head`) has written `--out` before
/// it prints the table and is ended by SIGPIPE.
#[test]
fn bench_writes_out_before_a_closed_stdout_ends_it() {
    use std::os::unix::process::ExitStatusExt;
    let md = tmp("bench-out-before-print.md");
    let _ = std::fs::remove_file(&md);
    let (reader, writer) = std::io::pipe().unwrap();
    // Closed before the bench starts: its first print meets a pipe with no reader.
    drop(reader);
    let out = ragged_to(&quick_comm_into(&md), writer);
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{out:?}");
    let written = std::fs::read_to_string(&md).expect("--out written");
    assert!(written.contains("| all-gather | 2 | 8192 |"), "{written}");
}

/// Standard output on a full disk: every subcommand exits 1 with one line saying so, no panic
/// (it was `failed printing to stdout` and exit 101).
#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    let small_validate = [
        "validate",
        "--model",
        "llama3_8b",
        "--optimizer",
        "adamw",
        "--scale",
        "64",
        "--units",
        "1",
        "--worlds",
        "1",
        "--steps",
        "1",
    ];
    let mut bench = QUICK_COMM.to_vec();
    bench.extend(["--out", "-"]);
    let plan = ["plan", "--model", "llama3_8b", "--devices", "8"];
    let cases: [&[&str]; 6] = [
        &["checkpoint", "info", "tests/data/muon-v-for-every-matrix"],
        &["checkpoint", "verify", "tests/data/muon-v-for-every-matrix"],
        &small_validate,
        &bench,
        &plan,
        &[&plan[..], &["--svg", "-"]].concat(),
    ];
    for args in cases {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = ragged_to(args, full);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("error: print: -: No space left on device") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

/// World sizes past the thread-rank limit are refused by the argument check, before the
/// model's data is built for every rank (it took 9.5 GB at 100000).
#[test]
fn validate_refuses_more_thread_ranks_than_one_process_runs_before_any_work() {
    let out = ragged(&[
        "validate",
        "--model",
        "llama3_8b",
        "--optimizer",
        "adamw",
        "--worlds",
        "1,5000",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("world 5000 is more than 4096 thread ranks"),
        "{err}"
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!said.contains("steps"), "it started: {said}");
}

/// Out-of-range planner flags are refused naming the flag, the value as typed and the range;
/// no `Debug` dump of the options and no unrelated `unit root:`.
#[test]
fn plan_cost_model_flags_out_of_range_name_the_flag_and_value() {
    let cases: [(&str, &str); 8] = [
        ("--max-buffers=0", "--max-buffers 0: must be at least 1"),
        ("--max-buffers=65", "--max-buffers 65: must be at most 64"),
        (
            "--alpha-us=-5",
            "--alpha-us -5: must be a finite number from 0 to 1000000 µs",
        ),
        ("--alpha-us=NaN", "--alpha-us NaN: "),
        (
            "--link-gbs=0",
            "--link-gbs 0: must be a finite number from 0.001 to 1000000 GB/s",
        ),
        ("--link-gbs=1e300", "--link-gbs 1e300: "),
        ("--link-gbs=inf", "--link-gbs inf: "),
        ("--alpha-us=1e7", "--alpha-us 10000000: "),
    ];
    for (flag, want) in cases {
        let out = ragged(&["plan", "--model", "llama3_8b", "--devices", "8", flag]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} accepted");
        assert!(err.contains(want), "{flag}: {err:?} lacks {want:?}");
        assert!(
            !err.contains(" { ") && !err.contains("unit root"),
            "{flag}: {err}"
        );
    }
}

/// `--json` and `--svg` may not name the same file (both `-` included) nor the `--model` file
/// read (it was replaced by the plan); the model is left as it was.
#[test]
fn plan_outputs_may_not_name_each_other_or_the_model() {
    let dir = tmp("plan-outputs");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("mine.json");
    let text = r#"{"model":"mine","params":[{"name":"a","shape":[4,4]}]}"#;
    std::fs::write(&model, text).unwrap();
    let link = dir.join("link.json");
    std::os::unix::fs::symlink(&model, &link).unwrap();
    let (m, l) = (model.to_str().unwrap(), link.to_str().unwrap());
    let same = dir.join("same");
    let s = same.to_str().unwrap();
    let dotted = format!("{}/./same", dir.display());
    let cases: [(&[&str], &str); 5] = [
        (&["--json", m], "--json"),
        (&["--svg", l], "--svg"),
        (&["--json", s, "--svg", s], "--svg"),
        (&["--json", s, "--svg", &dotted], "--svg"),
        (&["--json", "-", "--svg", "-"], "--svg -"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["plan", "--model", m, "--devices", "2"];
        args.extend_from_slice(flags);
        let out = ragged(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} accepted");
        assert!(err.contains(want), "{flags:?}: {err}");
        assert!(out.stdout.is_empty(), "{flags:?} printed");
    }
    assert_eq!(std::fs::read_to_string(&model).unwrap(), text);
    assert!(!same.exists());
}

/// A model name from the user's file is printed escaped: a terminal escape sequence in it does
/// not run (`checkpoint info` escapes its strings the same way).
#[test]
fn plan_prints_names_from_the_model_file_escaped() {
    let model = tmp("escape-name.json");
    let json =
        r#"{"model":"evil\u001b[2J\nname","params":[{"name":"layers.0.a\u0007","shape":[4,4]}]}"#;
    std::fs::write(&model, json).unwrap();
    let out = ragged(&["plan", "--model", model.to_str().unwrap(), "--devices", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(r"evil\u{1b}[2J\nname: 1 tensors"), "{text}");
    assert!(
        !text.contains('\u{1b}') && !text.contains('\u{7}'),
        "{text:?}"
    );
}

/// An inventory saved with a UTF-8 byte-order mark (some Windows editors) reads as without.
#[test]
fn plan_reads_an_inventory_with_a_byte_order_mark() {
    let model = tmp("bom.json");
    std::fs::write(
        &model,
        "\u{feff}{\"params\":[{\"name\":\"a\",\"shape\":[4,4]}]}",
    )
    .unwrap();
    let out = ragged(&["plan", "--model", model.to_str().unwrap(), "--devices", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A safetensors file with a zero-size tensor (legal in the format, not plannable): the error
/// names the file.
#[test]
fn plan_of_a_safetensors_with_a_zero_size_tensor_names_the_file() {
    let path = tmp("zero-size.safetensors");
    let mut header = r#"{"a":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}}"#.to_string();
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    std::fs::write(&path, bytes).unwrap();
    let out = ragged(&["plan", "--model", path.to_str().unwrap(), "--devices", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("safetensors {}", path.display())) && err.contains("zero-sized"),
        "{err}"
    );
}

/// `--paired` runs world 1 only: `--batch` is checked against that, not against the default
/// `--worlds` it never runs; without `--paired` a batch the worlds cannot split is refused
/// naming `--batch`.
#[test]
fn bench_train_checks_batch_against_the_worlds_that_run() {
    let tiny = [
        "bench", "train", "--layers", "1", "--width", "8", "--hidden", "8", "--steps", "1",
        "--batch", "6", "--out", "-",
    ];
    let out = ragged(&[&tiny[..], &["--paired"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ragged(&[&tiny[..], &["--worlds", "1,4"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--batch 6: must split evenly over 4 ranks"),
        "{err}"
    );
}

/// Counts past the cap are refused, naming the flag (they ran silently for ever), and
/// `bench plan` names `--worlds` and `--blocks` in its refusals.
#[test]
fn bench_counts_are_capped_and_plan_errors_name_the_flag() {
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "bench",
                "comm",
                "--repeats",
                "18446744073709551615",
                "--out",
                "-",
            ],
            "--repeats 18446744073709551615: must be at most 10000",
        ),
        (
            &[
                "bench",
                "plan",
                "--models",
                "llama3_8b",
                "--repeats",
                "10001",
                "--out",
                "-",
            ],
            "--repeats 10001: must be at most 10000",
        ),
        (
            &["bench", "checkpoint", "--repeats", "10001", "--out", "-"],
            "--repeats 10001: must be at most 10000",
        ),
        (
            &["bench", "optim", "--ghz", "1e-300", "--out", "-"],
            "--ghz 1e-300: must be a finite number from 0.1 to 100 GHz",
        ),
        (
            &[
                "bench",
                "plan",
                "--models",
                "llama3_8b",
                "--blocks",
                "bogus",
                "--out",
                "-",
            ],
            "--blocks \"bogus\"",
        ),
        (
            &[
                "bench",
                "plan",
                "--models",
                "llama3_8b",
                "--worlds",
                "144115188075855871",
                "--out",
                "-",
            ],
            "--worlds 144115188075855871 with model llama3_8b",
        ),
    ];
    for (args, want) in cases {
        let out = ragged(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
        assert!(out.stdout.is_empty(), "{args:?} printed a table");
    }
}
