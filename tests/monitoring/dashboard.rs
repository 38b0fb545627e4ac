//! deploy/monitoring's dashboard and alert rules, read as written: every
//! dashboard target, filled in as Grafana would, every rule's expression,
//! and the panels without thresholds.

use crate::JOB;
use serde_json::Value;
use std::path::Path;

pub fn dashboard() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring/dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// (panel title, refId, PromQL) of every target, as written.
pub fn dashboard_targets() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for panel in dashboard()["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                panel["title"].as_str().unwrap().to_owned(),
                target["refId"].as_str().unwrap().to_owned(),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// Every target, with the Grafana variables filled in as Grafana would for
/// this job and instance at a 1 s scrape.
pub fn dashboard_queries(instance: &str) -> Vec<(String, String, String)> {
    let fill = |expr: &str| {
        expr.replace("$__rate_interval", "5s")
            .replace("$__interval", "1s")
            .replace("$__range", "5m")
            .replace("$job", JOB)
            .replace("$instance", instance)
    };
    dashboard_targets()
        .into_iter()
        .map(|(title, ref_id, expr)| (title, ref_id, fill(&expr)))
        .collect()
}

/// Panels without a threshold step above the base colour, in their
/// defaults or an override.
pub fn panels_without_thresholds() -> Vec<String> {
    let steps = |t: &Value| t["steps"].as_array().map_or(0, |s| s.len());
    dashboard()["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] != "row")
        .filter(|p| {
            let config = &p["fieldConfig"];
            let overrides = config["overrides"].as_array().into_iter().flatten();
            let in_overrides = overrides
                .flat_map(|o| o["properties"].as_array().into_iter().flatten())
                .any(|prop| prop["id"] == "thresholds" && steps(&prop["value"]) >= 2);
            steps(&config["defaults"]["thresholds"]) < 2 && !in_overrides
        })
        .map(|p| p["title"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Every (alert name, expression) of deploy/monitoring/alerts.yaml.
pub fn alert_rules() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring/alerts.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut rules = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line.trim().strip_prefix("- alert: ") else {
            continue;
        };
        let (at, expr_line) = lines[i + 1..]
            .iter()
            .enumerate()
            .find(|(_, l)| l.trim_start().starts_with("expr:"))
            .unwrap_or_else(|| panic!("{name} has an expr"));
        let at = i + 1 + at;
        let first = expr_line.trim_start().trim_start_matches("expr:").trim();
        let expr = if first == ">-" {
            lines[at + 1..]
                .iter()
                .take_while(|l| indent(l) > indent(expr_line) && !l.trim().is_empty())
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            first.to_owned()
        };
        rules.push((name.to_owned(), expr));
    }
    rules
}

/// Target `ref_id` of the dashboard panel `title`, as written.
pub fn target(title: &str, ref_id: &str) -> String {
    dashboard_targets()
        .into_iter()
        .find(|(t, r, _)| t == title && r == ref_id)
        .map(|(_, _, expr)| expr)
        .unwrap_or_else(|| panic!("the dashboard has no panel {title:?} {ref_id}"))
}
