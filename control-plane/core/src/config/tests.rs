//! Validation errors name the field, the value and the reason.

use super::*;
use kvgate_scheduler::{CostUnit, Mode};

fn model(name: &str) -> RawModel {
    RawModel { name: name.into(), block_size: Some(16), ..Default::default() }
}

#[test]
fn errors_name_field_value_and_reason() {
    let mut raw = RawConfig { models: vec![model("m")], ..Default::default() };
    raw.models[0].block_size = Some(0);
    let e = Config::validate(raw).unwrap_err();
    assert_eq!(e.field, "models[0].block_size");
    assert_eq!(e.value, "0");
    assert!(e.to_string().contains("must be > 0"), "{e}");

    let mut raw = RawConfig { models: vec![model("m")], ..Default::default() };
    raw.models[0].mode = Some("fastest".into());
    let e = Config::validate(raw).unwrap_err();
    assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].mode", "fastest"));

    let raw = RawConfig { listen_grpc: Some("localhost".into()), models: vec![model("m")], ..Default::default() };
    assert_eq!(Config::validate(raw).unwrap_err().field, "listen_grpc");

    let raw = RawConfig { models: vec![model("m"), model("m")], ..Default::default() };
    assert_eq!(Config::validate(raw).unwrap_err().reason, "duplicate model");

    let mut raw = RawConfig { models: vec![model("m")], ..Default::default() };
    raw.models[0].kv = Some(RawKv { temperature: Some(f64::NAN), ..Default::default() });
    assert_eq!(Config::validate(raw).unwrap_err().field, "models[0].kv.temperature");

    assert_eq!(Config::validate(RawConfig::default()).unwrap_err().field, "models");
}

#[test]
fn toml_file_parses_and_rejects_unknown_fields() {
    let raw = RawConfig::from_toml(
        "listen_grpc = \"127.0.0.1:0\"\n[[models]]\nname = \"m\"\nblock_size = 32\nmode = \"round_robin\"\nworkers = [{ id = \"a\", endpoint = \"127.0.0.1:8000\" }]\n[models.kv]\noverlap_weight = 2.0\n",
        "config.toml",
    )
    .unwrap();
    let c = Config::validate(raw).unwrap();
    assert_eq!(c.models[0].routing.block_size.get(), 32);
    assert_eq!(c.models[0].routing.mode, Mode::RoundRobin);
    assert_eq!(c.models[0].routing.kv.overlap_weight, 2.0);
    assert_eq!(c.models[0].routing.kv.unit, CostUnit::Time);
    let blocks =
        "listen_grpc = \"127.0.0.1:0\"\n[[models]]\nname = \"m\"\nblock_size = 32\n[models.kv]\nunit = \"blocks\"\n";
    let b = Config::validate(RawConfig::from_toml(blocks, "config.toml").unwrap()).unwrap();
    assert_eq!(b.models[0].routing.kv.unit, CostUnit::Blocks);
    assert!(b.models[0].routing.learn_timing, "learning is the default");
    assert!(b.models[0].routing.fading_load, "so is pricing decode by the load it lives with");
    let pinned =
        blocks.replace("unit = \"blocks\"", "learn_timing = false\nfading_load = false\nprefill_ms_per_token = 0.2");
    let p = Config::validate(RawConfig::from_toml(&pinned, "config.toml").unwrap()).unwrap();
    assert!(!p.models[0].routing.learn_timing);
    assert!(!p.models[0].routing.fading_load);
    assert_eq!(p.models[0].routing.kv.prefill_ms_per_token, 0.2);
    let bad = blocks.replace("\"blocks\"", "\"tokens\"");
    let e = Config::validate(RawConfig::from_toml(&bad, "config.toml").unwrap()).unwrap_err();
    assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].kv.unit", "tokens"), "{e}");
    let zero = "listen_grpc = \"127.0.0.1:0\"\n[[models]]\nname = \"m\"\nblock_size = 32\n[models.kv]\nprefill_ms_per_token = 0.0\n";
    let e = Config::validate(RawConfig::from_toml(zero, "config.toml").unwrap()).unwrap_err();
    assert_eq!(e.field, "models[0].kv.prefill_ms_per_token", "{e}");
    let negative = zero.replace("prefill_ms_per_token = 0.0", "ttft_weight = -1.0");
    let e = Config::validate(RawConfig::from_toml(&negative, "config.toml").unwrap()).unwrap_err();
    assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].kv.ttft_weight", "-1"), "{e}");
    assert_eq!(c.models[0].routing.static_workers, vec![("a".to_owned(), "127.0.0.1:8000".to_owned())]);
    let e = RawConfig::from_toml("listen_grpcc = \"x\"\n", "config.toml").unwrap_err();
    assert_eq!(e.field, "config.toml");
    assert!(e.reason.contains("listen_grpcc"), "{e}");
}

#[test]
fn tls_files_come_together_and_hold_pem() {
    let dir = std::env::temp_dir().join(format!("kvgate-tls-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cert = dir.join("tls.crt");
    let key = dir.join("tls.key");
    let junk = dir.join("junk.pem");
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n").unwrap();
    std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n").unwrap();
    std::fs::write(&junk, "not pem").unwrap();
    let with = |c: Option<&Path>, k: Option<&Path>, ca: Option<&Path>| {
        Config::validate(RawConfig {
            tls_cert_file: c.map(Path::to_path_buf),
            tls_key_file: k.map(Path::to_path_buf),
            tls_client_ca_file: ca.map(Path::to_path_buf),
            models: vec![model("m")],
            ..Default::default()
        })
    };
    assert_eq!(with(None, None, None).unwrap().tls, None);
    let t = with(Some(&cert), Some(&key), Some(&cert)).unwrap().tls.unwrap();
    assert_eq!((t.cert, t.key, t.client_ca), (cert.clone(), key.clone(), Some(cert.clone())));
    assert_eq!(with(Some(&cert), Some(&key), None).unwrap().tls.unwrap().client_ca, None);
    // An empty value (an unset environment variable in a manifest) is unset.
    assert_eq!(with(Some(Path::new("")), Some(Path::new("")), None).unwrap().tls, None);

    let e = with(Some(&cert), None, None).unwrap_err();
    assert_eq!((e.field.as_str(), e.reason.as_str()), ("tls_key_file", "required with tls_cert_file"));
    assert_eq!(with(None, Some(&key), None).unwrap_err().field, "tls_cert_file");
    assert_eq!(with(None, None, Some(&cert)).unwrap_err().field, "tls_cert_file");
    let e = with(Some(&junk), Some(&key), None).unwrap_err();
    assert_eq!(e.field, "tls_cert_file");
    assert!(e.reason.contains("no PEM block of CERTIFICATE"), "{e}");
    assert_eq!(with(Some(&cert), Some(&cert), None).unwrap_err().field, "tls_key_file");
    assert_eq!(with(Some(&cert), Some(&key), Some(&key)).unwrap_err().field, "tls_client_ca_file");
    let e = with(Some(&dir.join("missing.crt")), Some(&key), None).unwrap_err();
    assert!(e.reason.starts_with("cannot read"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn session_affinity_is_off_by_default_and_validated() {
    let c = Config::validate(RawConfig { models: vec![model("m")], ..Default::default() }).unwrap();
    assert_eq!(c.models[0].routing.session, crate::model::SessionConfig::default());
    assert!(!c.models[0].routing.session.enabled);
    let text = "[[models]]\nname = \"m\"\nblock_size = 16\n[models.session]\nenabled = true\nttl_ms = 60000\n";
    let on = Config::validate(RawConfig::from_toml(text, "config.toml").unwrap()).unwrap();
    assert!(on.models[0].routing.session.enabled);
    assert_eq!(on.models[0].routing.session.ttl_ms, 60_000);
    let short = Config::validate(RawConfig::from_toml(&text.replace("60000", "10"), "c").unwrap()).unwrap_err();
    assert_eq!((short.field.as_str(), short.value.as_str()), ("models[0].session.ttl_ms", "10"), "{short}");
    let none = text.replace("ttl_ms = 60000", "max_sessions = 0");
    let e = Config::validate(RawConfig::from_toml(&none, "c").unwrap()).unwrap_err();
    assert_eq!(e.field, "models[0].session.max_sessions");
    assert!(RawConfig::from_toml(&text.replace("enabled", "on"), "c").is_err(), "unknown fields are errors");
}

#[test]
fn overload_protection_is_off_by_default_and_validated() {
    let c = Config::validate(RawConfig { models: vec![model("m")], ..Default::default() }).unwrap();
    assert_eq!(c.models[0].routing.overload, None);
    let text = "[[models]]\nname = \"m\"\nblock_size = 16\n[models.overload]\nenabled = true\nmax_wait_ms = 2000\n";
    let on = Config::validate(RawConfig::from_toml(text, "c").unwrap()).unwrap();
    let q = on.models[0].routing.overload.unwrap();
    assert_eq!((q.max_wait_ms, q.max_queued, q.quantum), (2000, 1024, 8192));
    let e = Config::validate(RawConfig::from_toml(&text.replace("2000", "5"), "c").unwrap()).unwrap_err();
    assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].overload.max_wait_ms", "5"), "{e}");
    let e = Config::validate(RawConfig::from_toml(&text.replace("max_wait_ms = 2000", "max_queued = 0"), "c").unwrap());
    assert_eq!(e.unwrap_err().field, "models[0].overload.max_queued");
}

#[test]
fn disaggregation_is_on_with_a_derived_threshold_and_validated() {
    let c = Config::validate(RawConfig { models: vec![model("m")], ..Default::default() }).unwrap();
    assert_eq!(c.models[0].routing.disaggregation, crate::model::DisaggConfig::default());
    let text = "[[models]]\nname = \"m\"\nblock_size = 16\n[models.disaggregation]\nmin_uncached_tokens = 2048\n";
    let on = Config::validate(RawConfig::from_toml(text, "c").unwrap()).unwrap();
    assert_eq!(on.models[0].routing.disaggregation.min_uncached_tokens, Some(2048));
    let zero = text.replace("2048", "0");
    let e = Config::validate(RawConfig::from_toml(&zero, "c").unwrap()).unwrap_err();
    assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].disaggregation.min_uncached_tokens", "0"), "{e}");
    let ms = text.replace("min_uncached_tokens = 2048", "max_local_prefill_ms = 0.5");
    let e = Config::validate(RawConfig::from_toml(&ms, "c").unwrap()).unwrap_err();
    assert_eq!(e.field, "models[0].disaggregation.max_local_prefill_ms");
    let w = text.replace("min_uncached_tokens = 2048", "stall_weight = 0");
    let c = Config::validate(RawConfig::from_toml(&w, "c").unwrap()).unwrap();
    assert_eq!(c.models[0].routing.disaggregation.stall_weight, 0.0);
    let nan = text.replace("min_uncached_tokens = 2048", "stall_weight = nan");
    let e = Config::validate(RawConfig::from_toml(&nan, "c").unwrap()).unwrap_err();
    assert_eq!(e.field, "models[0].disaggregation.stall_weight");
    let both = text.replace("min_uncached_tokens = 2048", "prefill_on_both = true");
    let c = Config::validate(RawConfig::from_toml(&both, "c").unwrap()).unwrap();
    assert!(c.models[0].routing.disaggregation.prefill_on_both);
    assert!(!on.models[0].routing.disaggregation.prefill_on_both, "off unless asked");
    let over = text.replace("min_uncached_tokens = 2048", "overflow_to_prefill = true");
    let c = Config::validate(RawConfig::from_toml(&over, "c").unwrap()).unwrap();
    assert!(c.models[0].routing.disaggregation.overflow_to_prefill);
    assert!(!on.models[0].routing.disaggregation.overflow_to_prefill, "off unless asked");
}

#[test]
fn index_shards_default_to_one_and_are_bounded() {
    let raw = RawConfig { models: vec![model("m")], ..Default::default() };
    assert_eq!(Config::validate(raw).unwrap().models[0].routing.index_shards, 1);
    let text = "[[models]]\nname = \"m\"\nblock_size = 16\nindex_shards = 4\n";
    let c = Config::validate(toml::from_str(text).unwrap()).unwrap();
    assert_eq!(c.models[0].routing.index_shards, 4);
    for bad in [0u16, 65] {
        let mut raw = RawConfig { models: vec![model("m")], ..Default::default() };
        raw.models[0].index_shards = Some(bad);
        let e = Config::validate(raw).unwrap_err();
        assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].index_shards", bad.to_string().as_str()));
    }
}
