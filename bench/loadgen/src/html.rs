//! The HTML report: one self-contained page (no script, no external file)
//! with the markdown tables of a result file turned into HTML tables and the
//! SVG charts inline.

use std::fmt::Write as _;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// `**bold**` spans to `<strong>`, the rest escaped.
fn inline(s: &str) -> String {
    let mut out = String::new();
    for (i, part) in esc(s).split("**").enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<strong>{part}</strong>");
        } else {
            out.push_str(part);
        }
    }
    out
}

fn cells(line: &str) -> Vec<&str> {
    let t = line.trim();
    let t = t.strip_prefix('|').unwrap_or(t);
    let t = t.strip_suffix('|').unwrap_or(t);
    t.split('|').map(str::trim).collect()
}

/// The markdown this crate writes (headings, paragraphs, pipe tables) as HTML.
pub fn markdown(md: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = md.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        if l.trim().is_empty() {
            i += 1;
        } else if let Some(h) = l.strip_prefix("# ") {
            let _ = writeln!(out, "<h1>{}</h1>", inline(h));
            i += 1;
        } else if let Some(h) = l.strip_prefix("## ") {
            let _ = writeln!(out, "<h2>{}</h2>", inline(h));
            i += 1;
        } else if l.trim_start().starts_with('|') {
            out.push_str("<table>\n");
            let head = cells(l);
            out.push_str("<tr>");
            for c in &head {
                let _ = write!(out, "<th>{}</th>", inline(c));
            }
            out.push_str("</tr>\n");
            i += 1;
            // The alignment row.
            if i < lines.len() && lines[i].contains("---") {
                i += 1;
            }
            while i < lines.len() && lines[i].trim_start().starts_with('|') {
                out.push_str("<tr>");
                for c in cells(lines[i]) {
                    let _ = write!(out, "<td>{}</td>", inline(c));
                }
                out.push_str("</tr>\n");
                i += 1;
            }
            out.push_str("</table>\n");
        } else {
            let _ = writeln!(out, "<p>{}</p>", inline(l));
            i += 1;
        }
    }
    out
}

/// The whole page: the tables of `md`, then every chart.
pub fn page(title: &str, md: &str, charts: &[String]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n<style>\n\
         body {{ font-family: sans-serif; margin: 2em; color: #222; }}\n\
         table {{ border-collapse: collapse; margin: 1em 0; font-size: 13px; }}\n\
         th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}\n\
         th {{ background: #f4f4f4; }}\n\
         .charts {{ display: flex; flex-wrap: wrap; gap: 12px; }}\n\
         </style></head><body>\n",
        esc(title)
    );
    s.push_str(&markdown(md));
    s.push_str("<h2>Charts</h2>\n<div class=\"charts\">\n");
    for c in charts {
        s.push_str(c);
    }
    s.push_str("</div>\n</body></html>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_headings_and_bold_become_html() {
        let md = "# Sweep <1>\n\ncommit x\n\n**a vs b** (note)\n\n| conc. | TTFT |\n|---:|---|\n| 60 | 300 / 240 (−20 %) |\n| 80 | 1 |\n";
        let h = markdown(md);
        assert!(h.contains("<h1>Sweep &lt;1&gt;</h1>"), "{h}");
        assert!(h.contains("<p><strong>a vs b</strong> (note)</p>"), "{h}");
        assert!(h.contains("<tr><th>conc.</th><th>TTFT</th></tr>"), "{h}");
        assert!(h.contains("<tr><td>60</td><td>300 / 240 (−20 %)</td></tr>"), "{h}");
        assert_eq!(h.matches("<tr>").count(), 3, "the alignment row is not a row");
        let p = page("t", md, &["<svg></svg>".into()]);
        assert!(p.starts_with("<!doctype html>") && p.contains("<svg></svg>") && p.ends_with("</html>\n"));
    }
}
