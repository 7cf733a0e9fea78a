"""The page's CSS (token colours, panels, banner, popups), passed to launch(css=...)."""

CSS = """
.dfl-hero h1 {margin-bottom: 0.2em;}
.dfl-hero p {margin: 0.2em 0;}
.dfl-demo {background:#fff7ed; border:1px solid #fdba74; color:#7c2d12; border-radius:8px; padding:8px 12px; margin:6px 0;}
.dfl-models {font-size:0.9em; color:#374151;}
.dfl-models code {font-size:0.95em;}
.dfl-banner {border-radius:10px; padding:12px 16px; font-size:1.02em; border:1px solid #d1d5db; background:#f9fafb; color:#111827;}
.dfl-banner.run {background:#eff6ff; border-color:#93c5fd;}
.dfl-banner.warn {background:#fffbeb; border-color:#fcd34d;}
.dfl-banner.done {background:#ecfdf5; border-color:#6ee7b7; display:flex; align-items:center; gap:18px; flex-wrap:wrap;}
.dfl-banner.done.slow {background:#fffbeb; border-color:#fcd34d;}
.dfl-banner.slow .dfl-x {color:#b45309;}
.dfl-banner.done.plain, .dfl-banner.done.even {background:#f3f4f6; border-color:#d1d5db;}
.dfl-banner.plain .dfl-x, .dfl-banner.even .dfl-x {color:#374151;}
.dfl-x {font-size:clamp(1.4em, 6vw, 2.1em); font-weight:800; color:#047857; overflow-wrap:anywhere;}
.dfl-detail {color:#1f2937;}
.dfl-panel {border:1px solid #e5e7eb; border-radius:10px; background:#ffffff; color:#111827; min-height:220px;}
.dfl-panel.spec {border-top:4px solid #10b981;}
.dfl-panel.ar {border-top:4px solid #9ca3af;}
.dfl-head {display:flex; justify-content:space-between; align-items:baseline; gap:8px; flex-wrap:wrap;
  padding:8px 12px; border-bottom:1px solid #f3f4f6; background:#fafafa; border-radius:10px 10px 0 0;}
.dfl-title {font-weight:700;}
.dfl-rate {font-size:0.92em; color:#374151;}
.dfl-stream {padding:10px 12px; white-space:pre-wrap; word-break:break-word; line-height:1.75;
  font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:0.9em;}
.tok {border-radius:3px; padding:1px 0;}
.tok.accepted {background:#bbf7d0; color:#14532d;}
.tok.correction {background:#fed7aa; color:#7c2d12;}
.tok.bonus {background:#c7d2fe; color:#312e81;}
.tok.target {background:transparent; color:#111827;}
.rej {color:#b91c1c; text-decoration:line-through; text-decoration-thickness:2px;}
.rnd {position:relative; cursor:help; border-bottom:1px dotted #9ca3af;}
.rnd:hover, .rnd:focus {outline:1px solid #6b7280; border-radius:3px;}
.rnd .pop {display:none; position:absolute; left:0; top:1.9em; z-index:50; width:max-content; max-width:min(460px, 80vw);
  white-space:normal; background:#111827; color:#f9fafb; padding:8px 10px; border-radius:8px; font-size:0.85em;
  line-height:1.6; box-shadow:0 6px 20px rgba(0,0,0,.25);}
.rnd .pop b {color:#f9fafb;}
.rnd .pop .rej {color:#fca5a5;}
.rnd:hover .pop, .rnd:focus .pop {display:block;}
.cursor {color:#10b981; animation: dfl-blink 1s steps(2) infinite;}
@keyframes dfl-blink {50% {opacity:0;}}
.placeholder {color:#9ca3af; font-style:italic;}
.dfl-legend {display:flex; flex-wrap:wrap; gap:10px; align-items:center; font-size:0.88em; color:#111827;}
.dfl-legend .tok {padding:2px 6px;}
.dfl-legend .hint {color:#6b7280; font-style:italic;}
.dfl-tau {border:1px solid #e5e7eb; border-radius:10px; padding:14px; text-align:center; background:#fff; color:#111827;}
.dfl-tau-v {font-size:2.2em; font-weight:800; color:#047857;}
.dfl-tau-l {font-size:0.85em; color:#4b5563;}
.dfl-msg {border-radius:8px; padding:10px 14px; margin:4px 0; font-weight:600;}
.dfl-msg.error {background:#fef2f2; border:1px solid #fca5a5; color:#991b1b;}
.dfl-msg.warn {background:#fffbeb; border:1px solid #fcd34d; color:#92400e;}
.dfl-msg.info {background:#eff6ff; border:1px solid #93c5fd; color:#1e3a8a;}
.blk-list {font-size:0.85em; max-height:360px; overflow-y:auto; font-family: ui-monospace, Menlo, Consolas, monospace;}
.blk-row {display:flex; gap:10px; padding:3px 0; border-bottom:1px solid #f3f4f6; color:#111827;}
.blk-cap {min-width:330px; color:#4b5563;}
.blk-note {color:#6b7280; font-style:italic;}
"""
