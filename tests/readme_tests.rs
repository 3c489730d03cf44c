//! The README's code is compiled code: its "use it on your own model" snippet is the marked
//! part of `examples/own_model.rs` (which `cargo test --all-targets` builds), verbatim.

#[test]
fn the_readme_shows_the_own_model_example_verbatim() {
    let root = env!("CARGO_MANIFEST_DIR");
    let example = std::fs::read_to_string(format!("{root}/examples/own_model.rs")).unwrap();
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let begin =
        example.find("// README:begin\n").expect("begin marker") + "// README:begin\n".len();
    let end = example.find("\n// README:end").expect("end marker") + 1;
    let snippet = &example[begin..end];
    assert!(
        snippet.lines().count() > 20,
        "the marked part is the whole example"
    );
    assert!(
        readme.contains(snippet),
        "README.md must contain examples/own_model.rs between its markers, verbatim"
    );
}
