"""Interactive pieces of the notebook app (anywidget: JupyterLab, Notebook 7 and VS Code).

`BlockMapWidget` draws one (b, h) panel of a block scan on a canvas. Hovering a block shows
(b, h, q block, kv block, class, kept pairs); clicking a block sets `clicked`; dragging a box zooms
into those blocks (double-click: whole map). It only draws what `look.block_grid` computed.
"""

from __future__ import annotations

import anywidget
import traitlets

from workbench.look import BLOCK_COLOURS, BLOCK_LABELS, BlockGrid
from workbench.blocks import EMPTY, FULL, PARTIAL

__all__ = ["BlockMapWidget"]

_ESM = r"""
const CLASS_NAMES = {NAMES};
const CLASS_COLOURS = {COLOURS};
const CLASS_LEGEND = {LEGEND};

function bytesOf(view) {
  // a synced Bytes trait arrives as a DataView (or ArrayBuffer): copy it to an aligned buffer
  if (!view) return new ArrayBuffer(0);
  if (view instanceof ArrayBuffer) return view;
  return view.buffer.slice(view.byteOffset, view.byteOffset + view.byteLength);
}

function render({ model, el }) {
  el.classList.add("wb-blockmap");
  const div = (css, cls) => {  // an element of the widget: its style, and a class tests can find
    const d = document.createElement("div");
    d.style.cssText = css;
    if (cls) d.className = cls;
    return d;
  };
  const small = "font:11px system-ui,sans-serif;color:#5a6776";
  const caption = div("font:12px system-ui,sans-serif;color:#1d2733;margin:2px 0 4px", "wb-blockmap-caption");
  const wrap = div("position:relative;display:inline-block");
  const canvas = document.createElement("canvas");
  canvas.style.cssText = "border:1px solid #c0c6cc;cursor:crosshair;display:block";
  const tip = div("position:absolute;pointer-events:none;background:#1d2733;color:#fff;font:11px monospace;" +
    "padding:3px 6px;border-radius:4px;white-space:pre;display:none;z-index:10", "wb-blockmap-tip");
  const hint = div(small + ";margin-top:3px");
  hint.textContent = "hover: a block's numbers · click: Token zoom there · drag: zoom into a box · double-click: whole map";
  // axes (keys across, queries down, as in the static figures) and the colour legend
  const top = div(small + ";display:flex;justify-content:space-between", "wb-blockmap-axis");
  const left = div(small + ";writing-mode:vertical-rl;display:flex;justify-content:space-between;margin-right:3px",
                   "wb-blockmap-axis");
  const row = div("display:flex;align-items:stretch");
  const legend = div("font:11px system-ui,sans-serif;color:#1d2733;margin-top:3px", "wb-blockmap-legend");
  for (const k of [2, 1, 0]) {
    const sw = document.createElement("span");
    sw.style.cssText = `display:inline-block;width:10px;height:10px;margin:0 4px 0 10px;vertical-align:-1px;` +
      `border:1px solid #c0c6cc;background:${CLASS_COLOURS[k]}`;
    legend.append(sw, document.createTextNode(CLASS_LEGEND[k]));
  }
  wrap.append(canvas, tip);
  row.append(left, wrap);
  el.append(caption, top, row, legend, hint);

  let grid = null;  // {rows, cols, classes, kept}
  let view = null;  // [r0, r1, c0, c1) in cells
  let drag = null;
  let pending = null;  // a click waiting to see whether a second one makes it a double-click

  function load() {
    const rows = model.get("rows"), cols = model.get("cols");
    grid = { rows, cols, classes: new Uint8Array(bytesOf(model.get("classes"))),
             kept: new Float64Array(bytesOf(model.get("kept"))) };
    const z = model.get("zoom");
    view = z && z.length === 4 ? z.slice() : [0, rows, 0, cols];
    draw();
  }

  function size() {
    const side = model.get("side");
    const aspect = model.get("q_len") / model.get("kv_len");
    return aspect >= 1 ? [Math.max(120, Math.round(side / aspect)), side] : [side, Math.max(120, Math.round(side * aspect))];
  }

  function draw() {
    if (!grid.rows || !grid.cols) {  // nothing to show: the mask did not build at these settings
      canvas.width = 1; canvas.height = 1; top.textContent = ""; left.textContent = "";
      caption.textContent = model.get("title") || "no block map";
      return;
    }
    const [w, h] = size();
    canvas.width = w; canvas.height = h;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = CLASS_COLOURS[0]; ctx.fillRect(0, 0, w, h);
    const [r0, r1, c0, c1] = view;
    const cw = w / (c1 - c0), ch = h / (r1 - r0);
    for (let r = r0; r < r1; r++) {
      for (let c = c0; c < c1; c++) {
        const k = grid.classes[r * grid.cols + c];
        if (k === 0) continue;
        ctx.fillStyle = CLASS_COLOURS[k];
        ctx.fillRect((c - c0) * cw, (r - r0) * ch, Math.ceil(cw), Math.ceil(ch));
      }
    }
    if (cw >= 4 && ch >= 4) {  // block boundaries, while blocks are a few pixels wide
      ctx.strokeStyle = "rgba(255,255,255,0.8)"; ctx.lineWidth = 1; ctx.beginPath();
      for (let c = 1; c < c1 - c0; c++) { ctx.moveTo(Math.round(c * cw) + 0.5, 0); ctx.lineTo(Math.round(c * cw) + 0.5, h); }
      for (let r = 1; r < r1 - r0; r++) { ctx.moveTo(0, Math.round(r * ch) + 0.5); ctx.lineTo(w, Math.round(r * ch) + 0.5); }
      ctx.stroke();
    }
    const sel = model.get("clicked");
    if (sel && sel.cell_q !== undefined && sel.cell_q >= r0 && sel.cell_q < r1 && sel.cell_kv >= c0 && sel.cell_kv < c1) {
      ctx.strokeStyle = "#d62828"; ctx.lineWidth = 2;
      ctx.strokeRect((sel.cell_kv - c0) * cw + 1, (sel.cell_q - r0) * ch + 1, Math.max(3, cw - 2), Math.max(3, ch - 2));
    }
    if (drag && drag.moved) {
      ctx.strokeStyle = "#d62828"; ctx.lineWidth = 1; ctx.setLineDash([4, 3]);
      ctx.strokeRect(Math.min(drag.x0, drag.x1), Math.min(drag.y0, drag.y1), Math.abs(drag.x1 - drag.x0), Math.abs(drag.y1 - drag.y0));
      ctx.setLineDash([]);
    }
    const qb = model.get("q_block") * model.get("pool_q"), kb = model.get("kv_block") * model.get("pool_kv");
    const tok = (i, n, len) => Math.min(i * n, len);
    top.innerHTML = `<span>kv ${tok(c0, kb, model.get("kv_len"))}</span><span>keys (kv_idx)</span>` +
      `<span>${tok(c1, kb, model.get("kv_len")) - 1}</span>`;
    left.innerHTML = `<span>q ${tok(r0, qb, model.get("q_len"))}</span><span>queries (q_idx)</span>` +
      `<span>${tok(r1, qb, model.get("q_len")) - 1}</span>`;
    top.style.width = `${w}px`; top.style.marginLeft = "16px";
    caption.textContent = `${model.get("title")} · ${model.get("panel")} · q ${tok(r0, qb, model.get("q_len"))}..` +
      `${tok(r1, qb, model.get("q_len")) - 1}, kv ${tok(c0, kb, model.get("kv_len"))}..${tok(c1, kb, model.get("kv_len")) - 1}` +
      ` · ${grid.rows} x ${grid.cols} ${model.get("pool_q") * model.get("pool_kv") > 1 ? "cells" : "blocks"}` +
      (r1 - r0 < grid.rows || c1 - c0 < grid.cols ? " (zoomed)" : "");
  }

  function cellAt(ev) {
    const rect = canvas.getBoundingClientRect();
    const x = (ev.clientX - rect.left) * canvas.width / rect.width, y = (ev.clientY - rect.top) * canvas.height / rect.height;
    const [r0, r1, c0, c1] = view;
    const c = Math.min(c1 - 1, c0 + Math.floor(x / (canvas.width / (c1 - c0))));
    const r = Math.min(r1 - 1, r0 + Math.floor(y / (canvas.height / (r1 - r0))));
    return { r, c, x, y };
  }

  function describe(r, c) {
    const pq = model.get("pool_q"), pk = model.get("pool_kv");
    const qb = model.get("q_block"), kb = model.get("kv_block");
    const qLen = model.get("q_len"), kvLen = model.get("kv_len");
    const q0 = r * pq * qb, q1 = Math.min((r + 1) * pq * qb, qLen), k0 = c * pk * kb, k1 = Math.min((c + 1) * pk * kb, kvLen);
    const blocks = pq * pk > 1 ? `q blocks ${r * pq}..${(r + 1) * pq - 1}, kv blocks ${c * pk}..${(c + 1) * pk - 1}`
                               : `q block ${r}, kv block ${c}`;
    const kept = grid.kept[r * grid.cols + c];
    return `${model.get("panel")}, ${blocks}\nq ${q0}..${q1 - 1}, kv ${k0}..${k1 - 1}\n` +
           `${CLASS_NAMES[grid.classes[r * grid.cols + c]]}: ${kept.toLocaleString()} of ${((q1 - q0) * (k1 - k0)).toLocaleString()} pairs kept`;
  }

  canvas.addEventListener("mousemove", (ev) => {
    if (!grid.rows) return;
    const { r, c, x, y } = cellAt(ev);
    if (drag) { drag.x1 = x; drag.y1 = y; drag.moved = drag.moved || Math.abs(x - drag.x0) + Math.abs(y - drag.y0) > 6; draw(); }
    tip.textContent = describe(r, c);
    tip.style.display = "block";
    tip.style.left = `${Math.min(x + 14, canvas.width - 40)}px`;
    tip.style.top = `${y + 14}px`;
  });
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  canvas.addEventListener("mousedown", (ev) => { const { x, y } = cellAt(ev); drag = { x0: x, y0: y, x1: x, y1: y, moved: false }; });
  canvas.addEventListener("mouseup", (ev) => {
    const d = drag; drag = null;
    if (!d || !grid.rows) return;
    const end = cellAt(ev);
    if (d.moved) {  // zoom into the dragged box
      const a = cellAt({ clientX: d.x0 * canvas.getBoundingClientRect().width / canvas.width + canvas.getBoundingClientRect().left,
                         clientY: d.y0 * canvas.getBoundingClientRect().height / canvas.height + canvas.getBoundingClientRect().top });
      view = [Math.min(a.r, end.r), Math.max(a.r, end.r) + 1, Math.min(a.c, end.c), Math.max(a.c, end.c) + 1];
      model.set("zoom", view.slice()); model.save_changes();
    } else {  // a click: tell Python which block, unless it turns out to be half of a double-click
      clearTimeout(pending);
      pending = setTimeout(() => {
        const n = (model.get("clicked").n || 0) + 1;
        model.set("clicked", { cell_q: end.r, cell_kv: end.c, q_block: end.r * model.get("pool_q"),
                               kv_block: end.c * model.get("pool_kv"), n });
        model.save_changes();
      }, 300);
    }
    draw();
  });
  canvas.addEventListener("dblclick", () => {
    clearTimeout(pending);
    view = [0, grid.rows, 0, grid.cols]; model.set("zoom", []); model.save_changes(); draw();
  });
  for (const name of ["classes", "kept", "rows", "cols", "side", "title", "panel"]) model.on(`change:${name}`, load);
  model.on("change:clicked", draw);
  load();
}

export default { render };
"""


class BlockMapWidget(anywidget.AnyWidget):
    """One panel of a block map that answers the mouse. `clicked` holds the last clicked block
    ({"q_block", "kv_block", ...}); `zoom` the [r0, r1, c0, c1) cells in view ([] = all)."""

    _esm = _ESM.replace("{NAMES}", repr({EMPTY: BLOCK_LABELS[EMPTY].split(" ")[0], PARTIAL: "partial", FULL: "full"})
                        .replace("'", '"')).replace(
        "{COLOURS}", repr({k: BLOCK_COLOURS[k] for k in (EMPTY, PARTIAL, FULL)}).replace("'", '"')).replace(
        "{LEGEND}", repr({k: BLOCK_LABELS[k] for k in (EMPTY, PARTIAL, FULL)}).replace("'", '"'))
    rows = traitlets.Int(0).tag(sync=True)
    cols = traitlets.Int(0).tag(sync=True)
    classes = traitlets.Bytes(b"").tag(sync=True)
    kept = traitlets.Bytes(b"").tag(sync=True)
    q_len = traitlets.Int(1).tag(sync=True)
    kv_len = traitlets.Int(1).tag(sync=True)
    q_block = traitlets.Int(128).tag(sync=True)
    kv_block = traitlets.Int(128).tag(sync=True)
    pool_q = traitlets.Int(1).tag(sync=True)
    pool_kv = traitlets.Int(1).tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    panel = traitlets.Unicode("b=0, h=0").tag(sync=True)
    side = traitlets.Int(460).tag(sync=True)
    clicked = traitlets.Dict({}).tag(sync=True)
    zoom = traitlets.List([]).tag(sync=True)

    def show(self, grid: BlockGrid, scan, title: str) -> None:
        """Draw `grid` (from `look.block_grid(scan, b, h)`); one sync for all fields."""
        with self.hold_sync():
            self.rows, self.cols = grid.classes.shape
            self.classes = grid.classes.tobytes()
            self.kept = grid.kept.astype("<f8").tobytes()
            self.q_len, self.kv_len = scan.q_len, scan.kv_len
            self.q_block, self.kv_block = scan.q_block, scan.kv_block
            self.pool_q, self.pool_kv = grid.pool_q, grid.pool_kv
            self.title, self.panel = title, f"b={grid.b}, h={grid.h}"
            self.zoom = []
            self.clicked = {}  # a block picked at other settings would mark another block

    def clear(self, title: str = "no block map: the mask did not build at these settings") -> None:
        """Show nothing (rather than the last mask's blocks) while the settings give no mask."""
        with self.hold_sync():
            self.rows = self.cols = 0
            self.classes, self.kept = b"", b""
            self.title, self.zoom, self.clicked = title, [], {}
