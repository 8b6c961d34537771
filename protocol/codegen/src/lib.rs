//! Code generation for `kvgate-protocol`.
//!
//! The protocol crate must build for `wasm32-wasip1` without `protoc`, so its
//! prost code is generated here (with `protox`, a protobuf compiler written in
//! Rust) and checked in at `protocol/src/gen/kvgate.v1.rs`.
//!
//! The control plane's tonic service code (server and client of
//! `kvgate.v1.Router`, referring to the protocol crate's messages) is
//! generated here too and checked in at
//! `control-plane/server/src/gen/kvgate.v1.tonic.rs`.
//!
//! The endpoint picker's subset of Envoy's ext_proc protocol
//! (`envoy/service/ext_proc/v3/kvgate_subset.proto`: messages and the
//! server of `envoy.service.ext_proc.v3.ExternalProcessor`) is generated
//! into `control-plane/epp/src/gen/envoy.service.ext_proc.v3.rs`.
//!
//! Every path is relative to the repository's root ([`repo_root`]).
//!
//! * `cargo run -p kvgate-protocol-codegen` (or `make proto`) rewrites all
//!   three.
//! * The test `checked_in_code_matches_proto` fails when the `.proto` files
//!   and the checked-in code have drifted apart.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The proto files, relative to [`proto_root`], in compilation order.
pub const PROTO_FILES: &[&str] = &["kvgate/v1/router.proto", "kvgate/v1/events.proto"];

/// The protobuf package; the generated file is named after it.
pub const PACKAGE: &str = "kvgate.v1";

/// The repository's root (this crate is `protocol/codegen`).
pub fn repo_root() -> PathBuf {
    // At run time first: cargo and nextest set it for `cargo run` and tests,
    // and a build reused from a checkout elsewhere (one shared target
    // directory) would otherwise point at that checkout.
    let here = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    here.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or(here)
}

/// `protocol/proto`.
pub fn proto_root() -> PathBuf {
    repo_root().join("protocol/proto")
}

/// `protocol/src/gen/kvgate.v1.rs`, the checked-in output.
pub fn generated_path() -> PathBuf {
    repo_root().join("protocol/src/gen").join(format!("{PACKAGE}.rs"))
}

/// `control-plane/server/src/gen/kvgate.v1.tonic.rs`, the checked-in
/// service code.
pub fn service_path() -> PathBuf {
    repo_root().join("control-plane/server/src/gen").join(format!("{PACKAGE}.tonic.rs"))
}

fn compile(root: &Path) -> Result<prost_types::FileDescriptorSet> {
    let files: Vec<PathBuf> = PROTO_FILES.iter().map(|f| root.join(f)).collect();
    protox::compile(&files, [root]).context("compiling the .proto files")
}

/// Compiles the proto files found under `root` and returns the Rust code
/// prost generates for [`PACKAGE`].
pub fn generate(root: &Path) -> Result<String> {
    let fds = compile(root)?;
    let out = tempdir()?;
    let mut config = prost_build::Config::new();
    // BTreeMap for map fields: HashMap does not exist in no_std.
    config.out_dir(&out).btree_map(["."]);
    config.compile_fds(fds).context("generating Rust code")?;
    let path = out.join(format!("{PACKAGE}.rs"));
    let code = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let _ = std::fs::remove_dir_all(&out);
    Ok(format!("{HEADER}{code}"))
}

/// The tonic server and client code of the services in [`PACKAGE`], with
/// messages taken from `kvgate_protocol::pb` (not generated again).
pub fn generate_service(root: &Path) -> Result<String> {
    let config = tonic_prost_build::configure().build_client(true).extern_path(".kvgate.v1", "::kvgate_protocol::pb");
    tonic_code(config, compile(root)?, PACKAGE)
}

/// Runs tonic's generator (servers always, with transport) on `fds` and
/// returns the code of `package`, with [`HEADER`].
fn tonic_code(
    config: tonic_prost_build::Builder,
    fds: prost_types::FileDescriptorSet,
    package: &str,
) -> Result<String> {
    let out = tempdir()?;
    config
        .build_server(true)
        .build_transport(true)
        .out_dir(&out)
        .compile_fds(fds)
        .with_context(|| format!("generating tonic code for {package}"))?;
    let path = out.join(format!("{package}.rs"));
    let code = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let _ = std::fs::remove_dir_all(&out);
    Ok(format!("{HEADER}{code}"))
}

/// The ext_proc subset, relative to [`proto_root`].
pub const EXT_PROC_FILE: &str = "envoy/service/ext_proc/v3/kvgate_subset.proto";

/// Its protobuf package.
pub const EXT_PROC_PACKAGE: &str = "envoy.service.ext_proc.v3";

/// `control-plane/epp/src/gen/envoy.service.ext_proc.v3.rs`.
pub fn ext_proc_path() -> PathBuf {
    repo_root().join("control-plane/epp/src/gen").join(format!("{EXT_PROC_PACKAGE}.rs"))
}

/// Messages and server (no client) of the ext_proc subset; Struct comes
/// from `prost-types`.
pub fn generate_ext_proc(root: &Path) -> Result<String> {
    let fds = protox::compile([root.join(EXT_PROC_FILE)], [root]).context("compiling the ext_proc subset")?;
    tonic_code(tonic_prost_build::configure().build_client(false), fds, EXT_PROC_PACKAGE)
}

/// Every generated file: (checked-in path, fresh code).
pub fn generate_all(root: &Path) -> Result<Vec<(PathBuf, String)>> {
    Ok(vec![
        (generated_path(), generate(root)?),
        (service_path(), generate_service(root)?),
        (ext_proc_path(), generate_ext_proc(root)?),
    ])
}

/// Checks every generated file against its checked-in copy.
pub fn check_all(root: &Path) -> Result<()> {
    for (path, fresh) in generate_all(root)? {
        let current = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        if let Some(diff) = first_difference(&current, &fresh) {
            bail!("{} is out of date with the .proto files ({diff}); run `make proto`", path.display());
        }
    }
    Ok(())
}

/// Prepended to the generated file.
pub const HEADER: &str = "// @generated by kvgate-protocol-codegen from protocol/proto.\n\
// Do not edit: change the .proto files and run `make proto`.\n";

/// Where two texts first differ, as a short human-readable description, or
/// `None` when they are equal.
pub fn first_difference(checked_in: &str, fresh: &str) -> Option<String> {
    if checked_in == fresh {
        return None;
    }
    let mut a = checked_in.lines();
    let mut b = fresh.lines();
    let mut line = 1usize;
    loop {
        match (a.next(), b.next()) {
            (Some(x), Some(y)) if x == y => line += 1,
            (x, y) => {
                return Some(format!(
                    "line {line}: checked in {:?}, generated {:?}",
                    x.unwrap_or("<end of file>"),
                    y.unwrap_or("<end of file>")
                ));
            }
        }
    }
}

/// Regenerates and compares with the checked-in file.
pub fn check(root: &Path, checked_in: &Path) -> Result<()> {
    let fresh = generate(root)?;
    let current = std::fs::read_to_string(checked_in).with_context(|| format!("reading {}", checked_in.display()))?;
    if let Some(diff) = first_difference(&current, &fresh) {
        bail!("{} is out of date with the .proto files ({diff}); run `make proto`", checked_in.display());
    }
    Ok(())
}

fn tempdir() -> Result<PathBuf> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvgate-codegen-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
