//! The HTML report: one self-contained page (no script, no external file)
//! with the markdown tables of a result file turned into HTML tables and the
//! SVG charts inline.

use std::fmt::Write as _;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The markdown of a result file (headings, paragraphs, pipe tables) as
/// HTML, through `pulldown-cmark` with tables on.
pub fn markdown(md: &str) -> String {
    let parser = pulldown_cmark::Parser::new_ext(md, pulldown_cmark::Options::ENABLE_TABLES);
    let mut out = String::with_capacity(md.len() * 2);
    pulldown_cmark::html::push_html(&mut out, parser);
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
        assert!(h.contains("<th style=\"text-align: right\">conc.</th><th>TTFT</th>"), "{h}");
        assert!(h.contains("<td style=\"text-align: right\">60</td><td>300 / 240 (−20 %)</td>"), "{h}");
        assert_eq!(h.matches("<tr>").count(), 3, "the alignment row is not a row");
        let p = page("t", md, &["<svg></svg>".into()]);
        assert!(p.starts_with("<!doctype html>") && p.contains("<svg></svg>") && p.ends_with("</html>\n"));
    }
}
