//! The admin views (JSON) and the run-time mode switch.

use crate::app::App;

impl App {
    /// The admin view of workers (all models, or one).
    pub fn workers_json(&self, model: Option<&str>) -> serde_json::Value {
        let now = self.now_ms();
        let mut out = serde_json::Map::new();
        for (name, m) in &self.models {
            if model.is_some_and(|x| x != name) {
                continue;
            }
            let views = m.state.lock().worker_views(now);
            out.insert(name.clone(), serde_json::to_value(views).unwrap_or_default());
        }
        serde_json::Value::Object(out)
    }

    /// The admin view of the indexes and tokenizers.
    pub fn index_json(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for (name, m) in &self.models {
            let st = m.state.lock();
            // One read of the index for the whole view.
            let index = st.index();
            let mut v = serde_json::json!({
                "mode": st.mode().name(),
                "block_size": st.config().block_size.get(),
                "workers": index.worker_count(),
                "device_blocks": index.distinct_blocks(kvgate_index::Tier::Device),
                "host_blocks": index.distinct_blocks(kvgate_index::Tier::Host),
                "heap_bytes": index.approx_heap_bytes(),
                "events_applied": index.counters().events_applied,
                "inflight": st.inflight(),
            });
            drop(index);
            drop(st);
            if let Some(tk) = &m.tokenizer {
                let (tokens, entries) = tk.cache_size();
                v["tokenizer"] = serde_json::json!({
                    "segmented": tk.segmented(),
                    "fast_encoder": tk.inner().uses_fast_encoder(),
                    "paragraphs": tk.inner().encodes_by_paragraph(),
                    "self_test": tk.self_test_result(),
                    "cache_tokens": tokens,
                    "cache_entries": entries,
                });
            }
            out.insert(name.clone(), v);
        }
        serde_json::Value::Object(out)
    }

    /// The admin view of the engine timing learned per model and class:
    /// each fit's coefficients with standard errors and sample counts, the
    /// values `kv` uses, and the priors.
    pub fn timing_json(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for (name, m) in &self.models {
            let st = m.state.lock();
            let c = st.calibration();
            let kv = &st.config().kv;
            let classes: serde_json::Map<String, serde_json::Value> =
                c.classes().map(|(class, fit)| (class.to_owned(), fit.admin_json())).collect();
            let counters: serde_json::Map<String, serde_json::Value> =
                c.counters().by_kind().iter().map(|(k, v)| ((*k).to_owned(), (*v).into())).collect();
            out.insert(
                name.clone(),
                serde_json::json!({
                    "learn": c.learns(),
                    "prior": {"prefill_ms_per_token": kv.prefill_ms_per_token, "decode_ms_per_seq": kv.decode_ms_per_seq},
                    "observations": counters,
                    "open_requests": c.open_requests(),
                    "classes": classes,
                    "fading_load": {
                        "life_ms": st.persistence().life_ms(),
                        "decay_ms": st.persistence().decay_ms(),
                        "factor": st.persistence().factor(),
                    },
                }),
            );
        }
        serde_json::Value::Object(out)
    }

    /// Takes every model's timing journal ([`crate::timing::Calibration::journal_take`]):
    /// per model, the observations its fits learned from since the last
    /// take (`{"class", "obs"}` each) and how many were dropped. The first
    /// take starts the journals.
    pub fn timing_journal(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for (name, m) in &self.models {
            let (records, dropped) = m.state.lock().calibration_mut().journal_take();
            let records: Vec<serde_json::Value> =
                records.iter().map(|(class, o)| serde_json::json!({"class": &**class, "obs": o})).collect();
            out.insert(name.clone(), serde_json::json!({"dropped": dropped, "records": records}));
        }
        serde_json::Value::Object(out)
    }

    /// Switches a model's routing mode.
    pub fn set_mode(&self, model: &str, mode: &str) -> Result<(), String> {
        let m = self.models.get(model).ok_or_else(|| format!("unknown model {model:?}"))?;
        let mode: kvgate_scheduler::Mode = mode.parse()?;
        let mut st = m.state.lock();
        st.set_mode(mode);
        m.looks_up.store(mode == kvgate_scheduler::Mode::Kv, std::sync::atomic::Ordering::Relaxed);
        drop(st);
        tracing::info!(model, mode = mode.name(), "routing mode switched");
        Ok(())
    }
}
