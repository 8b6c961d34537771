//! The checked-in prost code must equal what the .proto files generate, and
//! the check must notice when they differ.

use std::path::Path;

use kvgate_protocol_codegen::{PROTO_FILES, check, first_difference, generate, generated_path, proto_root};

#[test]
fn checked_in_code_matches_proto() {
    if let Err(e) = kvgate_protocol_codegen::check_all(&proto_root()) {
        panic!("{e:#}");
    }
}

/// Copies the proto tree, adds a field to one message, and shows that the
/// drift check rejects the (unchanged) checked-in code against it.
#[test]
fn drift_check_fails_when_proto_changes() {
    let dir = std::env::temp_dir().join(format!("kvgate-drift-{}", std::process::id()));
    for f in PROTO_FILES {
        let src = proto_root().join(f);
        let dst = dir.join(f);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&src, &dst).unwrap();
    }
    let router = dir.join("kvgate/v1/router.proto");
    let text = std::fs::read_to_string(&router).unwrap();
    let changed = text.replacen(
        "  uint32 body_bytes = 12;\n",
        "  uint32 body_bytes = 12;\n  // A field the checked-in code lacks.\n  string drift_probe = 99;\n",
        1,
    );
    assert_ne!(text, changed, "the probe edit must apply");
    std::fs::write(&router, changed).unwrap();

    let err = check(&dir, &generated_path()).expect_err("drift must be detected");
    let msg = format!("{err:#}");
    assert!(msg.contains("out of date"), "{msg}");
    let fresh = generate(&dir).unwrap();
    assert!(fresh.contains("drift_probe"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn first_difference_reports_the_line() {
    assert_eq!(first_difference("a\nb\n", "a\nb\n"), None);
    let d = first_difference("a\nb\nc", "a\nx\nc").unwrap();
    assert!(d.starts_with("line 2:"), "{d}");
    let d = first_difference("a\n", "a\nb\n").unwrap();
    assert!(d.contains("<end of file>"), "{d}");
    assert!(Path::new(&generated_path()).exists());
}
