//! The one reader of metrics text for tests and the benchmark: the
//! Prometheus text format (vLLM, the simulator) and OpenMetrics (kvgate's
//! components, through `prometheus-client`) share their sample lines,
//! `name{labels} value`.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// The metric name (with `_total`, `_bucket`... as written).
    pub name: &'a str,
    /// The labels as written, without the braces (`""` when none).
    pub labels: &'a str,
    /// The value.
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `key`, unescaped only of `\"`.
    pub fn label(&self, key: &str) -> Option<String> {
        let mut rest = self.labels;
        while let Some(eq) = rest.find("=\"") {
            let k = rest[..eq].trim_start_matches(',').trim();
            let after = &rest[eq + 2..];
            let mut end = 0;
            let bytes = after.as_bytes();
            while end < bytes.len() && !(bytes[end] == b'"' && (end == 0 || bytes[end - 1] != b'\\')) {
                end += 1;
            }
            if k == key {
                return Some(after[..end].replace("\\\"", "\""));
            }
            rest = after.get(end + 1..).unwrap_or("");
        }
        None
    }
}

/// Every sample of `text` (comments, `# EOF` and malformed lines skipped).
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).filter_map(|l| {
        let (series, value) = l.trim().rsplit_once(' ')?;
        let value = value.parse::<f64>().ok()?;
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}')?),
            None => (series, ""),
        };
        Some(Sample { name, labels, value })
    })
}

/// The value of the first sample whose series, as written (`name` or
/// `name{labels}`), starts with `prefix`.
pub fn value(text: &str, prefix: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, v) = l.trim().rsplit_once(' ')?;
        series.starts_with(prefix).then(|| v.parse().ok()).flatten()
    })
}

/// The sum of every sample named exactly `name`, whatever its labels.
pub fn sum(text: &str, name: &str) -> f64 {
    samples(text).filter(|s| s.name == name).map(|s| s.value).sum()
}

/// The sum of every sample named exactly `name` whose label `key` is `value`.
pub fn sum_where(text: &str, name: &str, key: &str, value: &str) -> f64 {
    samples(text).filter(|s| s.name == name && s.label(key).as_deref() == Some(value)).map(|s| s.value).sum()
}

/// The distinct metric names of the samples.
pub fn names(text: &str) -> std::collections::BTreeSet<String> {
    samples(text).map(|s| s.name.to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x_total X.\n# TYPE x counter\nx_total{model=\"a \\\"b\\\"\",kind=\"k\"} 3\nx_total{model=\"c\",kind=\"k\"} 4\ny 1.5\nbad line\n# EOF\n";

    #[test]
    fn reads_samples_values_sums_and_labels() {
        let all: Vec<Sample<'_>> = samples(TEXT).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].label("model").as_deref(), Some("a \"b\""));
        assert_eq!(all[0].label("kind").as_deref(), Some("k"));
        assert_eq!(value(TEXT, "x_total{model=\"c\""), Some(4.0));
        assert_eq!(value(TEXT, "y"), Some(1.5));
        assert_eq!(sum(TEXT, "x_total"), 7.0);
        assert_eq!(sum_where(TEXT, "x_total", "model", "c"), 4.0);
        assert_eq!(sum_where(TEXT, "x_total", "kind", "k"), 7.0);
        assert_eq!(sum_where(TEXT, "x_total", "kind", "c"), 0.0);
        assert_eq!(names(TEXT).into_iter().collect::<Vec<_>>(), ["x_total", "y"]);
    }
}
