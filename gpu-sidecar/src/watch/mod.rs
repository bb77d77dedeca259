//! What the sidecar sees and concludes: one [`monitor`] round per scrape
//! interval feeds the breaker rules and publishes the state; [`alerts`]
//! (webhooks), [`history`] and [`traffic`] (the operator page's series),
//! [`money`] and [`spenders`] (spend against budgets, the top spenders),
//! [`rungs`] (the ladder's providers, from Envoy's health checks, with
//! [`first_check`] for hosts Envoy has not probed yet),
//! the [`kill_switch`], [`snapshot`] (what the last round saw, counters)
//! and [`memory`] (handing memory back after bursts). Imports `sources`,
//! `config`, `breaker` and the bottom layer only.

pub mod alerts;
pub mod first_check;
pub mod history;
pub mod kill_switch;
pub mod memory;
pub mod money;
pub mod monitor;
pub mod rungs;
pub mod snapshot;
pub mod spenders;
pub mod traffic;
