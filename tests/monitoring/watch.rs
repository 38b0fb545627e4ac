//! What the single-node session watches for: an alert firing or a panel
//! showing something, each with when its situation started, its threshold
//! and its promise; and the watcher that asks Prometheus about each until
//! it is seen.

use crate::POLL;
use crate::prometheus::{Prometheus, Sample};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

pub type Predicate = Box<dyn Fn(&[Sample]) -> bool + Send + Sync>;

pub enum Check {
    /// An alert is firing with `label` = `value`.
    Alert {
        name: &'static str,
        label: &'static str,
        value: String,
    },
    /// A dashboard panel's query result satisfies `pred`.
    Panel {
        title: &'static str,
        ref_id: &'static str,
        pred: Predicate,
    },
}

pub struct Watch {
    pub what: String,
    pub start: SystemTime,
    /// Seen earlier than this after `start` is a failure (a threshold).
    pub earliest: Duration,
    /// The promise at a 1 s scrape and evaluation interval.
    pub promise: Duration,
    /// The same at 30 s, for the report.
    pub promise_30s: &'static str,
    pub check: Check,
    pub seen: Option<Duration>,
}

pub fn alert(name: &'static str, label: &'static str, value: &str) -> Check {
    Check::Alert {
        name,
        label,
        value: value.to_owned(),
    }
}

pub fn panel(
    title: &'static str,
    ref_id: &'static str,
    pred: impl Fn(&[Sample]) -> bool + Send + Sync + 'static,
) -> Check {
    Check::Panel {
        title,
        ref_id,
        pred: Box::new(pred),
    }
}

pub fn any_with(label: &'static str, value: &str, min: f64) -> impl Fn(&[Sample]) -> bool + Send + Sync + 'static {
    let value = value.to_owned();
    move |r: &[Sample]| r.iter().any(|s| s.has(label, &value) && s.value >= min)
}

pub fn total_at_least(min: f64) -> impl Fn(&[Sample]) -> bool + Send + Sync + 'static {
    move |r: &[Sample]| r.iter().map(|s| s.value).sum::<f64>() >= min
}

#[derive(Default)]
pub struct Watched {
    pub watches: Vec<Watch>,
    /// (alertname, subscription_id or consumer_group) of every alert seen firing.
    pub fired: BTreeSet<(String, String)>,
    pub errors: Vec<String>,
}

impl Watched {
    pub fn add(
        &mut self,
        what: &str,
        start: SystemTime,
        earliest: Duration,
        promise: Duration,
        promise_30s: &'static str,
        check: Check,
    ) {
        self.watches.push(Watch {
            what: what.to_owned(),
            start,
            earliest,
            promise,
            promise_30s,
            check,
            seen: None,
        });
    }
}

/// Asks Prometheus every [`POLL`] about every watch not seen yet, and notes
/// every firing alert.
pub async fn watch(prometheus: Arc<Prometheus>, watched: Arc<Mutex<Watched>>, queries: Vec<(String, String, String)>) {
    loop {
        let now = SystemTime::now();
        match prometheus.firing().await {
            Ok(firing) => {
                let mut w = watched.lock().unwrap();
                for labels in &firing {
                    let key = ["subscription_id", "consumer_group", "reason"]
                        .iter()
                        .find_map(|k| labels.get(*k))
                        .cloned()
                        .unwrap_or_default();
                    w.fired.insert((labels["alertname"].clone(), key));
                }
                for watch in w.watches.iter_mut().filter(|w| w.seen.is_none()) {
                    if let Check::Alert { name, label, value } = &watch.check
                        && firing
                            .iter()
                            .any(|l| l["alertname"] == *name && l.get(*label) == Some(value))
                    {
                        watch.seen = Some(now.duration_since(watch.start).unwrap_or_default());
                    }
                }
            }
            Err(e) => watched.lock().unwrap().errors.push(e),
        }
        let pending: Vec<(usize, String)> = {
            let w = watched.lock().unwrap();
            w.watches
                .iter()
                .enumerate()
                .filter(|(_, w)| w.seen.is_none())
                .filter_map(|(i, w)| match &w.check {
                    Check::Panel { title, ref_id, .. } => queries
                        .iter()
                        .find(|(t, r, _)| t == title && r == ref_id)
                        .map(|(_, _, q)| (i, q.clone())),
                    Check::Alert { .. } => None,
                })
                .collect()
        };
        for (i, expr) in pending {
            let now = SystemTime::now();
            let result = prometheus.query(&expr).await;
            let mut w = watched.lock().unwrap();
            match result {
                Ok(samples) => {
                    let watch = &mut w.watches[i];
                    if let Check::Panel { pred, .. } = &watch.check
                        && pred(&samples)
                    {
                        watch.seen = Some(now.duration_since(watch.start).unwrap_or_default());
                    }
                }
                Err(e) => w.errors.push(format!("{expr}: {e}")),
            }
        }
        tokio::time::sleep(POLL).await;
    }
}
