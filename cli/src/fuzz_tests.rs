//! Fuzzing the `ragged` command line by proptest: arbitrary argument lists, drawn from the real
//! flags and hostile values (0, negative, NaN, ∞, sizes past memory and past `usize`) mixed
//! with arbitrary words. clap must return the parsed command or a clap error, never panic; a
//! parsed `plan` is then run on the built-in presets and must return `Ok` or `Err`; a parsed
//! `bench` goes through `bench_cmd::check`, the refusals every benchmark runs before it
//! measures anything (running the benchmarks themselves would take minutes per case and write
//! `docs/benchmarks.md`). No token can name an output file: `--json`, `--svg` and `--out` are
//! not in the vocabulary except as `--out=-`, and the arbitrary words never start with `-`.

use clap::Parser;
use proptest::prelude::*;

use crate::{bench_cmd, plan_cmd, Cli, Command};

/// One argument: a subcommand, a flag, a hostile or ordinary value, or an arbitrary word.
fn token() -> impl Strategy<Value = String> {
    let fixed = prop::sample::select(vec![
        "plan",
        "bench",
        "comm",
        "optim",
        "--model",
        "llama3_8b",
        "gpt_oss_20b",
        "no_such_model",
        "Cargo.toml",
        "--devices",
        "--block",
        "elem",
        "rows:0",
        "rows:3",
        "tile:32x32",
        "tile:32x48",
        "matrix",
        "whole",
        "--coll-align",
        "--start-align",
        "--order",
        "all",
        "module",
        "shape",
        "bogus",
        "--unit",
        "--no-baselines",
        "--worlds",
        "--shard",
        "--repeats",
        "--train-ranks",
        "--train-steps",
        "--reps",
        "--ghz",
        "--only",
        "adamw",
        "--device",
        "cpu",
        "cuda",
        "--no-write",
        "--out=-",
        "--models",
        "--blocks",
        "0",
        "1",
        "2",
        "3",
        "8",
        "-1",
        "nan",
        "inf",
        "-inf",
        "1e400",
        "4000000000",
        "18446744073709551615",
        "18446744073709551616",
        "0,1",
        "2,4",
        "",
        "--help",
        "--version",
    ]);
    prop_oneof![
        6 => fixed.prop_map(String::from),
        1 => "[a-z0-9:,.x]{0,8}",
    ]
}

/// A start that is often a valid command line, so the arbitrary tail reaches the commands.
fn prefix() -> impl Strategy<Value = Vec<String>> {
    let starts: Vec<&[&str]> = vec![
        &[],
        &["plan", "--model", "llama3_8b", "--devices"],
        &["plan", "--model", "gpt_oss_20b", "--devices", "3"],
        &["bench", "comm"],
        &["bench", "optim"],
        &["bench", "plan"],
        &["bench", "train"],
    ];
    prop::sample::select(starts).prop_map(|s| s.iter().map(|t| t.to_string()).collect())
}

/// Runs what parsed: `plan` fully, `bench` up to its checks. Only `Ok`/`Err` may come back.
fn run_parsed(cli: &Cli) -> ragged::Result<()> {
    match &cli.command {
        Command::Plan(args) => plan_cmd::run(args),
        Command::Bench(cmd) => bench_cmd::check(cmd),
        // Parsing only: a validation run trains optimizers for seconds to minutes.
        Command::Validate(_) => Ok(()),
        // Parsing only: `export` would write to whatever path the tokens name.
        Command::Checkpoint(_) => Ok(()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_argument_list_parses_or_is_a_clap_error_and_runs_to_ok_or_err(
        start in prefix(),
        args in prop::collection::vec(token(), 0..6),
    ) {
        let argv = std::iter::once("ragged".to_string()).chain(start).chain(args);
        match Cli::try_parse_from(argv) {
            Ok(cli) => {
                let _ = run_parsed(&cli);
            }
            Err(e) => {
                // A clap error renders as text (its own Display), whatever the input.
                prop_assert!(!e.to_string().is_empty());
            }
        }
    }
}

/// The hostile commands of issue 14, and the crash inputs the property found, in the parsed
/// form it runs: each is refused with an `Err`.
#[test]
fn the_issues_hostile_bench_commands_are_refused_by_the_checks() {
    for args in [
        &["bench", "comm", "--shard", "4000000000"][..],
        &["bench", "comm", "--worlds", "0"],
        &["bench", "optim", "--ghz", "-1"],
        &["bench", "optim", "--ghz", "nan"],
        &["bench", "optim", "--ghz", "inf"],
        &["bench", "optim", "--ghz", "0"],
        &["bench", "plan", "--repeats", "0"],
        // Found by the property above: the planner panicked ("the search returns a feasible
        // size", src/plan/search.rs:76) on a world whose V·coll_align overflows.
        &[
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "18446744073709551615",
        ],
    ] {
        let cli = Cli::try_parse_from(std::iter::once(&"ragged").chain(args)).unwrap();
        assert!(run_parsed(&cli).is_err(), "{args:?} passed the checks");
    }
}
