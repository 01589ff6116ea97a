"""The notebook workbench: an ipywidgets app over the stages. It composes them; no logic here.

    from workbench import Workbench
    Workbench("document", q_len=4096)           # a library mask
    Workbench(my_mask_mod)                      # your own mod (or a Mask, or "file.py:factory")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import ipywidgets as w
import torch
from IPython.display import display

from workbench import invariance, look, port
from workbench.analyze import mask_stats
from workbench.app.widgets import BlockMapWidget
from workbench.blocks import scan_blocks
from workbench.define import (Mask, WorkbenchError, bind, factory_params, implied_size, index_reads, library, make,
                              prepare)
from workbench.export import build_spec, write_spec
from workbench.run import Shape, defaults_for, make_inputs, run_flex
from workbench.verify import verify

__all__ = ["Workbench", "CUSTOM", "TABS"]


CUSTOM = "(your mod)"
TABS = ["Block map", "Token zoom", "Scores", "Stats", "Verify", "Invariance", "Benchmark", "Export"]


def _png(fig) -> bytes:
    return look.png(fig, close=True)


def _param_widget(name: str, default: Any) -> w.Widget:
    style = {"description_width": "initial"}
    if isinstance(default, bool):
        return w.Checkbox(value=default, description=name, style=style)
    if isinstance(default, int):
        return w.IntText(value=default, description=name, style=style, layout=w.Layout(width="180px"))
    if isinstance(default, float):
        return w.FloatText(value=default, description=name, style=style, layout=w.Layout(width="180px"))
    # lists and strings are edited as JSON; a None default stays empty and shows the value the
    # factory picks (set after each build), so it keeps following the lengths
    return w.Text(value="" if default is None else json.dumps(default), description=name, style=style,
                  continuous_update=False, layout=w.Layout(width="360px"))


def _param_value(widget: w.Widget):
    if isinstance(widget, w.Text):
        if not widget.value.strip():
            return None
        try:
            return json.loads(widget.value)
        except json.JSONDecodeError:
            return widget.value
    return widget.value


class Workbench:
    """Pick or bring a mask, change its parameters and sizes, and look, verify, benchmark and
    export it. `last_redraw_seconds` says how long the last redraw took."""

    def __init__(self, mask: str | Mask | Callable | None = "causal", params: dict | None = None, *,
                 q_len: int = 1024, kv_len: int | None = None, heads: int | None = None, batch: int | None = None,
                 block_size: int = 128, device: str | None = None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.custom: Mask | None = None
        self.mask: Mask | None = None
        self.scan = None
        self.last_redraw_seconds = 0.0
        self.timings: dict[str, float] = {}  # seconds of the last redraw's steps
        self.redraws = 0
        # the static picture of every head / batch panel is drawn off the redraw's path
        self.panels_image = w.Image(format="png", layout=w.Layout(display="none", max_width="100%"))
        self._painter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="panels")
        self.panels_done: concurrent.futures.Future | None = None
        self._generation = 0  # counts refreshes, so late background work knows it is stale
        self.shown: dict[str, object] = {}  # tab -> what it shows now (PNG bytes, DataFrame, text)
        self._quiet = False  # set while the app itself writes to its fields
        self.block_widget = BlockMapWidget()
        self.block_widget.observe(self._on_block_click, names="clicked")
        names = list(library())
        start = "causal"
        if isinstance(mask, str) and mask in names:
            start = mask
        elif mask is not None:
            self.custom = self._as_mask(mask, q_len, kv_len or q_len)
            start = CUSTOM
        style = {"description_width": "initial"}
        self.picker = w.Dropdown(options=names + [CUSTOM] if self.custom else names, value=start,
                                 description="mask", style=style)
        self.q_len = w.BoundedIntText(value=q_len, min=1, max=1 << 24, description="Lq", style=style,
                                      layout=w.Layout(width="170px"))
        self.kv_len = w.BoundedIntText(value=kv_len or q_len, min=1, max=1 << 24, description="Lk", style=style,
                                       layout=w.Layout(width="170px"))
        self.block = w.Dropdown(options=[16, 32, 64, 128, 256], value=block_size, description="block", style=style,
                                layout=w.Layout(width="150px"))
        self.heads = w.BoundedIntText(value=heads or 1, min=1, max=4096, description="heads", style=style,
                                      layout=w.Layout(width="150px"))
        self.head = w.BoundedIntText(value=0, min=0, max=4095, description="head", style=style,
                                     layout=w.Layout(width="140px"))
        self.batch = w.BoundedIntText(value=batch or 1, min=1, max=4096, description="batch", style=style,
                                      layout=w.Layout(width="150px"))
        self.params_box = w.HBox(layout=w.Layout(flex_flow="row wrap"))
        self.param_widgets: dict[str, w.Widget] = {}
        self.status = w.HTML()
        self.message = w.HTML()
        self.outputs = {name: w.Output() for name in TABS + ["Port"]}
        self.tabs = w.Tab(children=[self._tab_body(name) for name in TABS])
        for i, name in enumerate(TABS):
            self.tabs.set_title(i, name)
        self.picker.observe(self._on_pick, names="value")
        # Lk follows Lq while this is on (users raise Lq first; Lq > Lk is an error for most masks)
        self.same_len = w.Checkbox(value=kv_len is None or kv_len == q_len, description="Lk = Lq", indent=False,
                                   layout=w.Layout(width="80px"))
        self.q_len.observe(self._on_q_len, names="value")
        self.kv_len.observe(self._on_kv_len, names="value")
        self.same_len.observe(self._on_q_len, names="value")
        for widget in (self.block, self.heads, self.head, self.batch):
            widget.observe(self._on_change, names="value")
        self.heads_default, self.batch_default = self.heads.value, self.batch.value
        self._stale: set[str] = set()
        self.tabs.observe(self._on_tab, names="selected_index")
        self.widget = w.VBox([
            w.HBox([self.picker, self.q_len, self.kv_len, self.same_len, self.block, self.heads, self.head, self.batch],
                   layout=w.Layout(flex_flow="row wrap")),
            self.params_box, self.message, self.status, self.tabs])
        self._build_params(params)
        self.refresh()

    # ------------------------------------------------------------ building the mask

    @staticmethod
    def _as_mask(mask, q_len, kv_len) -> Mask:
        if isinstance(mask, Mask):
            return mask
        return make(mask, q_len=q_len, kv_len=kv_len)

    def _build_params(self, given: dict | None = None):
        self.param_widgets = {}
        if given and self.picker.value == CUSTOM:
            raise WorkbenchError("params are for library masks; your own mod takes none here",
                                 "pass a Mask built with its parameters, or a library name")
        if self.picker.value != CUSTOM:
            defaults = factory_params(library()[self.picker.value])
            unknown = sorted(set(given or {}) - set(defaults))
            if unknown:
                raise WorkbenchError(f"{self.picker.value} has no parameter {', '.join(unknown)}",
                                     f"its parameters are {', '.join(defaults) or 'none'}")
            for name, default in defaults.items():
                widget = _param_widget(name, default)
                if given and name in given:
                    widget.value = _param_widget(name, given[name]).value if isinstance(widget, w.Text) \
                        else given[name]
                widget.observe(self._on_change, names="value")
                self.param_widgets[name] = widget
        self.params_box.children = list(self.param_widgets.values())

    def params(self) -> dict:
        return {k: _param_value(v) for k, v in self.param_widgets.items()}

    def build(self) -> Mask:
        """The mask at the fields' sizes. A mod that reads `h` (or `b`) through a table of its own
        (`w[h]`) opens with as many heads (batch entries) as the table holds."""
        q_len, kv_len = self.q_len.value, self.kv_len.value
        target = self.custom if self.picker.value == CUSTOM else self.picker.value
        mask = prepare(target, self.params(), q_len, kv_len, self.device)
        if mask.heads is None and (heads := implied_size(mask, "h")):
            mask = mask.replace(heads=heads)
        if mask.batch is None and (batch := implied_size(mask, "b")):
            mask = mask.replace(batch=batch)
        return mask

    # ------------------------------------------------------------ events

    def _on_pick(self, _change):
        self._build_params()
        self.refresh()

    def _on_change(self, _change):
        if not self._quiet:
            self.refresh()

    def _on_q_len(self, _change):
        if self._quiet:
            return
        if self.same_len.value and self.kv_len.value != self.q_len.value:
            self._set_quietly(self.kv_len, self.q_len.value)
        self.refresh()

    def _on_kv_len(self, _change):
        if self._quiet:
            return
        if self.kv_len.value != self.q_len.value:
            self._set_quietly(self.same_len, False)  # the user set Lk on purpose
        self.refresh()

    def _on_block_click(self, change):
        """A block clicked in the map: Token zoom opens on it."""
        clicked = change["new"]
        if self.scan is None or "q_block" not in clicked:
            return
        r, c = clicked["q_block"], clicked["kv_block"]
        n = self.zoom_size.value
        q_centre = min(r * self.scan.q_block + self.scan.q_block // 2, self.q_len.value - 1)
        kv_centre = min(c * self.scan.kv_block + self.scan.kv_block // 2, self.kv_len.value - 1)
        self._set_quietly(self.zoom_q, max(0, min(q_centre - n // 2, self.q_len.value - n)))
        self._set_quietly(self.zoom_kv, max(0, min(kv_centre - n // 2, self.kv_len.value - n)))
        self.zoom_why.value = (f"<span style='color:#5a6776;font-size:12px'>where: block (q {r}, kv {c}) clicked in "
                               "the block map</span>")
        self._stale.add("Token zoom")
        self.tabs.selected_index = TABS.index("Token zoom")  # draws it (see _on_tab)
        if "Token zoom" in self._stale:
            self._draw_tab("Token zoom")

    def _on_zoom_field(self, change):
        if self._quiet:
            return
        if change["owner"] is self.zoom_size:
            self.zoom_chosen = self.zoom_size.value
        else:
            self.zoom_why.value = "<span style='color:#5a6776;font-size:12px'>where: as you set it</span>"
        self._draw_tab("Token zoom")

    def _set_quietly(self, widget, value):
        self._quiet = True
        try:
            widget.value = value
        finally:
            self._quiet = False

    def _on_tab(self, change):
        name = TABS[change["new"]]
        if name in self._stale:
            self._draw_tab(name)

    def _show_error(self, exc: Exception):
        text = exc.message if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
        if "kv_len" in text and "< q_len" in text:
            text += " In the app: tick Lk = Lq (Lk then follows Lq), or raise Lk first."
        self.message.value = (f"<div style='background:#fdecea;border-left:4px solid #d62828;padding:6px 10px'>"
                              f"{_esc(text)}</div>")

    def refresh(self):
        """Rebuild the mask and redraw what depends on it (the visible tab and the block map)."""
        start = time.perf_counter()
        self._generation += 1
        steps = {}
        self._clear_results()
        try:
            self.mask = self.build()
            self._show_mask_fields()
            steps["build"] = time.perf_counter() - start
            heads = self.mask.heads or self.heads.value  # a per-head mask shows all its heads
            # a new mod's fused kernel compiles on the side: this scan does not wait for it
            self.scan = scan_blocks(self.mask, self.q_len.value, self.kv_len.value, heads=heads,
                                    batch=self.mask.batch or self.batch.value, block_size=self.block.value,
                                    device=self.device, background_compile=True)
            steps["scan"] = time.perf_counter() - start - sum(steps.values())
            self.message.value = ""
            self._focus_zoom()
            steps["focus"] = time.perf_counter() - start - sum(steps.values())
        except Exception as exc:  # user code: show it, keep the app alive
            self.mask, self.scan = None, None
            self._show_error(exc)
            self.panels_image.layout.display = "none"  # no picture of the mask that was before
            self.status.value = ("<span style='color:#a4161a;font-size:12px'>no mask at these settings: the error above "
                                 "says why; nothing below describes them</span>")
            self.block_widget.clear()
        # draw the tab on screen now; the others when they are opened
        self._stale = {"Block map", "Stats", "Token zoom", "Scores"}
        self._draw_tab(TABS[self.tabs.selected_index or 0])
        steps["draw"] = time.perf_counter() - start - sum(steps.values())
        self.timings = steps
        self.last_redraw_seconds = time.perf_counter() - start
        self.redraws += 1
        if self.mask is not None:
            s = self.scan
            self.status.value = (f"<span style='color:#5a6776;font-size:12px'>{_esc(self.mask.name)} · Lq {s.q_len:,} x "
                                 f"Lk {s.kv_len:,} · {_esc(self._dependence())} · block scan "
                                 f"{s.engine} · redrawn in {self.last_redraw_seconds:.2f} s on {self.device}</span>")

    def _dependence(self) -> str:
        """What the status line says of heads and batch entries: only what the scan and the mod's
        graph show (a mod that reads h is never called the same for every head)."""
        s = self.scan
        reads = index_reads(self.mask.mask_mod) | index_reads(self.mask.score_mod, "score")
        parts = []
        for index, n, what, one, field, differs in (
                ("h", s.heads, "heads", "head", "heads", s.depends_on_head),
                ("b", s.batch, "batch entries", "batch entry", "batch", s.depends_on_batch)):
            if differs:
                parts.append(f"{n} {what} differ")
            elif index in reads:
                parts.append(f"reads {index}: {n} {one if n == 1 else what} shown"
                             + (f", set {field} to see more" if n == 1 else ", alike here"))
        return ", ".join(parts) or "same for every head and batch entry (the mods read neither h nor b)"

    def _show_mask_fields(self):
        """The fields say what the mask really is: a mask defined for N heads shows N (and fixes
        it), a parameter left to its default shows the value the factory picked."""
        for field, size, default in ((self.heads, self.mask.heads, self.heads_default),
                                     (self.batch, self.mask.batch, self.batch_default)):
            if size:
                self._set_quietly(field, size)
                field.disabled = True
                field.description_tooltip = "set by the mask (its tables hold this many)"
            elif field.disabled:
                field.disabled = False
                self._set_quietly(field, default)
        for name, widget in self.param_widgets.items():
            if isinstance(widget, w.Text) and not widget.value.strip() and name in self.mask.params:
                widget.placeholder = json.dumps(self.mask.params[name])

    def _focus_zoom(self):
        """Token zoom and Scores look where the mask's structure is (look.focus), and say why."""
        # the size the user chose; a closer view (a few differing tokens) shrinks it for this mask only
        where = look.focus(self.scan, self.zoom_chosen, h=self._head(), mask=self.mask, device=self.device)
        n = max(where.q_range[1] - where.q_range[0], where.kv_range[1] - where.kv_range[0])
        fitting = min((o for o in self.zoom_size.options if o >= n), default=self.zoom_chosen)
        self._set_quietly(self.zoom_size, min(fitting, self.zoom_chosen))
        self._set_quietly(self.zoom_q, where.q_range[0])
        self._set_quietly(self.zoom_kv, where.kv_range[0])
        self.focus = where
        self.zoom_why.value = f"<span style='color:#5a6776;font-size:12px'>where: {_esc(where.reason)}</span>"

    # ------------------------------------------------------------ tabs

    def _tab_body(self, name):
        out = self.outputs[name]
        if name == "Block map":
            return w.VBox([self.block_widget, self.panels_image, out])
        if name == "Token zoom":
            self.zoom_q = w.IntText(value=0, description="q from", layout=w.Layout(width="160px"))
            self.zoom_kv = w.IntText(value=0, description="kv from", layout=w.Layout(width="160px"))
            self.zoom_chosen = 256
            self.zoom_size = w.Dropdown(options=[64, 128, 256, 512, 1024, 2048], value=256, description="size",
                                        layout=w.Layout(width="160px"))
            self.zoom_why = w.HTML()
            for widget in (self.zoom_q, self.zoom_kv, self.zoom_size):
                widget.observe(self._on_zoom_field, names="value")
            return w.VBox([w.HBox([self.zoom_q, self.zoom_kv, self.zoom_size]), self.zoom_why, out])
        if name == "Verify":
            self.verify_dtype = w.Dropdown(options=["float32", "bfloat16", "float16"] +
                                           (["tf32"] if torch.cuda.is_available() else ["float64"]),
                                           value=defaults_for(self.device).dtype,
                                           description="dtype", layout=w.Layout(width="180px"))
            self.verify_len = w.IntText(value=512, description="verify at Lq=Lk", style={"description_width": "initial"},
                                        layout=w.Layout(width="200px"))
            self.verify_button = w.Button(description="Verify", button_style="primary", icon="check")
            self.verify_button.on_click(lambda _: self.run_verify())
            return w.VBox([w.HBox([self.verify_dtype, self.verify_len, self.verify_button]), out])
        if name == "Invariance":
            self.inv_backend = w.Dropdown(options=["flex", "eager", "port"], value="flex", description="backend",
                                          layout=w.Layout(width="180px"))
            self.inv_len = w.IntText(value=defaults_for(self.device).invariance_len, description="request tokens",
                                     style={"description_width": "initial"}, layout=w.Layout(width="200px"))
            self.inv_button = w.Button(description="Check layouts", icon="clone",
                                       tooltip="the request alone vs batched, packed, padded, chunked, decoded and "
                                               "run again, bit for bit")
            self.inv_button.on_click(lambda _: self.run_invariance())
            return w.VBox([w.HBox([self.inv_backend, self.inv_len, self.inv_button]), out])
        if name == "Benchmark":
            self.bench_button = w.Button(description="Benchmark", icon="tachometer",
                                         disabled=not torch.cuda.is_available())
            self.bench_button.on_click(lambda _: self.run_benchmark())
            return w.VBox([self.bench_button, out])
        if name == "Export":
            self.export_dir = w.Text(value="out/specs", description="folder")
            self.export_button = w.Button(description="Export spec", icon="download")
            self.export_button.on_click(lambda _: self.run_export())
            self.port_verify_button = w.Button(description="Verify port", icon="check",
                                               tooltip="the generated Triton attention file against the float64 "
                                                       "reference (on a GPU also timed against FlexAttention)")
            self.port_verify_button.on_click(lambda _: self.run_port_verify())
            # the port's verdict has an area of its own: verifying the port keeps the exported spec on screen
            return w.VBox([w.HBox([self.export_dir, self.export_button, self.port_verify_button]), out,
                           self.outputs["Port"]])
        return out

    def _draw_tab(self, name):
        out = self.outputs[name]
        if name in ("Verify", "Invariance", "Benchmark", "Export"):
            return
        self._stale.discard(name)
        out.clear_output(wait=True)
        if self.mask is None:
            return
        with out:
            try:
                if name == "Block map":
                    grid = look.block_grid(self.scan, b=0, h=self._head())
                    self.block_widget.show(grid, self.scan, title=self.mask.name)
                    self.shown[name] = grid
                    self._paint_panels()
                elif name == "Stats":
                    self.shown[name] = mask_stats(self.scan).to_frame()
                    display(self.shown[name])
                elif name == "Token zoom":
                    n = self.zoom_size.value
                    q0 = max(0, min(self.zoom_q.value, self.q_len.value - 1))
                    k0 = max(0, min(self.zoom_kv.value, self.kv_len.value - 1))
                    self.shown[name] = _show_png(look.token_view(
                        self.mask, (q0, min(self.q_len.value, q0 + n)), (k0, min(self.kv_len.value, k0 + n)),
                        h=self._head(), device=self.device))
                elif name == "Scores":
                    if self.mask.score_mod is None:
                        self.shown[name] = "No score_mod: scores are unchanged."
                        display(w.HTML(f"<i>{self.shown[name]}</i>"))
                    else:
                        where = look.focus(self.scan, 256, h=self._head(), mask=self.mask, device=self.device)
                        self.shown[name] = _show_png(look.score_view(self.mask, where.q_range, where.kv_range,
                                                                     h=self._head(), device=self.device))
            except Exception as exc:
                self._show_error(exc)

    def _paint_panels(self):
        """A mask that differs per head or batch entry also gets every panel side by side, drawn
        on a background thread so the map above answers at once; a newer redraw supersedes it."""
        self.shown.pop("Block map (all panels)", None)
        if not (self.scan.depends_on_head or self.scan.depends_on_batch):
            self.panels_image.layout.display = "none"
            self.panels_done = None
            return
        scan, title, generation = self.scan, self.mask.name, self._generation

        def paint():
            png = _png(look.block_map(scan, title=title))
            if self._generation == generation:  # still the mask on screen
                self.panels_image.value = png
                self.panels_image.layout.display = ""
                self.shown["Block map (all panels)"] = png
            return png

        self.panels_done = self._painter.submit(paint)

    def wait(self, timeout: float = 60) -> None:
        """Wait for the work the last redraw left on the side (the all-panels picture)."""
        if self.panels_done is not None:
            self.panels_done.result(timeout)

    def _head(self) -> int:
        limit = self.mask.heads or self.heads.value
        return min(self.head.value, limit - 1)

    # ------------------------------------------------------------ actions

    @contextlib.contextmanager
    def _action(self, tab: str):
        """Output of a button's action goes to its tab, under a line naming the mask and settings it
        belongs to; a failure becomes the app's message, and a later action clears it."""
        out = self.outputs[tab]
        out.clear_output()
        self.message.value = ""
        with out:
            if self.mask is not None:
                display(w.HTML(f"<div style='color:#5a6776;font-size:12px'>{_esc(self.settings_text())}</div>"))
            try:
                yield
            except Exception as exc:  # user code: show it, keep the app alive
                self._show_error(exc)

    def settings_text(self) -> str:
        """What a result on screen belongs to: the mask and the fields it was computed at."""
        params = ", ".join(f"{k}={v}" for k, v in self.params().items() if v not in (None, "")) if \
            self.picker.value != CUSTOM else ""
        return (f"{self.mask.name}" + (f" ({params})" if params else "") + f" · Lq {self.q_len.value:,} x Lk "
                f"{self.kv_len.value:,} · heads {self.mask.heads or self.heads.value} · batch "
                f"{self.mask.batch or self.batch.value} · block {self.block.value} · {self.device}")

    def _clear_results(self):
        """Results of the buttons (Verify, Invariance, Benchmark, Export, Port) belong to the mask and
        settings they ran at: a change clears them rather than leave them standing for another."""
        for tab in ("Verify", "Invariance", "Benchmark", "Export", "Port"):
            self.outputs[tab].clear_output()
            self.shown.pop(tab, None)
        self.last_verdict = self.last_invariance = self.last_spec = self.last_port = None

    def run_verify(self):

        with self._action("Verify"):
            if self.mask is None:
                return
            n = max(1, self.verify_len.value)
            mask = bind(self.mask, n, n, self.device) if (self.q_len.value, self.kv_len.value) != (n, n) else self.mask
            on_gpu = self.device.startswith("cuda")
            heads = self.mask.heads or self.heads.value
            verdict = verify(mask, Shape(batch=1, q_heads=heads, q_len=n, kv_len=n, head_dim=64),
                             dtype=self.verify_dtype.value, device=self.device, progress=True, backend="flex" if on_gpu else "eager")
            self.last_verdict = verdict
            colour = "#1e6b34" if verdict.passed else "#a4161a"
            display(w.HTML(f"<b style='color:{colour}'>{_esc(verdict.line)}</b>"))
            display(verdict.to_frame()[["max_abs_err", "rel_err", "worst", "bad_count", "nan_count", "passed"]])
            for f in verdict.findings:
                display(w.HTML(f"<div style='font-size:12px'><b>{_esc(f.kind)}</b> ({f.severity}): "
                               f"{_esc(f.message)}</div>"))

    def run_invariance(self):
        """The mask as one request under other layouts (workbench.invariance), bit for bit."""

        with self._action("Invariance"):
            if self.mask is None:
                return
            defaults = defaults_for(self.device)
            n = max(4, self.inv_len.value)
            target = self.custom if self.picker.value == CUSTOM else self.picker.value
            result = invariance.check(target, self.params() if self.picker.value != CUSTOM else None, q_len=n,
                                      heads=self.mask.heads or defaults.invariance_heads,
                                      head_dim=defaults.invariance_head_dim, dtype=defaults.dtype, device=self.device,
                                      backend=self.inv_backend.value, progress=True, options=invariance.InvarianceOptions(batch=defaults.invariance_batch))
            self.last_invariance = result
            self.shown["Invariance"] = result.line
            colour = "#1e6b34" if result.passed else "#a4161a"
            display(w.HTML(f"<b style='color:{colour}'>{_esc(result.line)}</b>"))
            display(result.to_frame()[["bitwise", "same_attention", "max_abs_diff", "max_ulp", "first_diff", "why"]]
                    .style.format({"max_abs_diff": "{:.3g}"})  # last-bit differences read as such, not 0.000000
                    .set_properties(**{"white-space": "pre-wrap", "text-align": "left", "font-size": "12px"}))

    def run_benchmark(self):

        with self._action("Benchmark"):
            if self.mask is None or not self.device.startswith("cuda"):
                self.shown["Benchmark"] = "Benchmarks need a CUDA GPU (see benchmarks/bench_attention.py)."
                display(w.HTML(f"<i>{self.shown['Benchmark']}</i>"))
                return
            from triton.testing import do_bench

            heads = self.mask.heads or max(self.heads.value, 16)
            shape = Shape(batch=self.batch.value, q_heads=heads, q_len=self.q_len.value, kv_len=self.kv_len.value,
                          head_dim=128)
            inputs = make_inputs(shape, "bfloat16", self.device, seed=0)
            first = run_flex(self.mask, inputs, block_size=self.block.value)
            ms = do_bench(lambda: run_flex(self.mask, inputs, block_mask=first.block_mask), warmup=5, rep=50)
            stats = mask_stats(self.scan, head_dim=128)
            tflops = stats.kept_flops / max(1, stats.batch * stats.heads) * shape.batch * heads / ms / 1e9
            self.shown["Benchmark"] = (f"compiled FlexAttention forward, bf16, B={shape.batch} H={heads} D=128: "
                                       f"{ms:.3f} ms, {tflops:.0f} TFLOP/s on kept pairs; compile "
                                       f"{first.compile_seconds or 0:.1f} s")
            display(w.HTML(self.shown["Benchmark"]))

    def run_export(self):

        with self._action("Export"):
            if self.mask is None:
                return
            reads = index_reads(self.mask.mask_mod) | index_reads(self.mask.score_mod, "score")
            spec = build_spec(self.mask, self.q_len.value, self.kv_len.value,
                              heads=self.mask.heads or (self.heads.value if "h" in reads else None),
                              batch=self.mask.batch or (self.batch.value if "b" in reads else None),
                              device=self.device, seed=0, progress=True)
            path, _ = write_spec(spec, Path(self.export_dir.value))
            self.last_spec = spec
            display(w.HTML(f"wrote <code>{_esc(str(path))}</code>; pattern <b>{_esc(spec.doc['pattern']['kind'])}"
                           f"</b>, score <b>{_esc(spec.doc['score']['kind'])}</b>"))
            display(spec.backends_view())  # a summary: long lists cut, source as a line count
            details = [w.HTML(f"<pre style='font-size:11px;max-height:320px;overflow:auto'>"
                              f"{_esc(json.dumps(spec.doc['backends'], indent=1, default=str))}</pre>")]
            titles = ["every section in full (JSON)"]
            if "triton" in spec.doc["backends"]:
                details.append(w.HTML(f"<pre style='font-size:11px;max-height:320px;overflow:auto'>"
                                      f"{_esc(spec.source('triton'))}</pre>"))
                titles.append("the mods in Triton (backends.triton.source)")
            display(w.Accordion(children=details, titles=tuple(titles)))
            self.last_port = None
            if spec.port is not None:
                self.last_port = path.with_name(spec.port.file_name)
                display(w.HTML(f"<b>Triton port</b> <code>{_esc(str(self.last_port))}</code> (valid for "
                               f"{_esc(spec.port.valid_for())}): attention(q, k, v) with torch and triton only"))
                source = w.Textarea(value=spec.port.source, layout=w.Layout(width="100%", height="260px"))
                display(w.Accordion(children=[source], titles=("port source",)))

    def run_port_verify(self):
        """The exported port (exported now if it was not) against the float64 reference at the
        verify length; on a GPU also timed beside compiled FlexAttention (`port.check`)."""

        with self._action("Port"):
            if self.mask is None:
                return
            n = max(1, min(self.q_len.value, 2048 if self.device.startswith("cuda") else 256))
            mask = bind(self.mask, n, n, self.device) if (self.q_len.value, self.kv_len.value) != (n, n) else self.mask
            heads = self.mask.heads or self.heads.value
            shape = Shape(batch=self.batch.value, q_heads=heads, q_len=n, kv_len=n,
                          head_dim=defaults_for(self.device).head_dim)
            result = port.check(mask, shape, self.device, progress=True)
            verdict = result.verdict
            self.last_verdict = verdict
            self.shown["Port"] = verdict.line if verdict is not None else result.note
            colour = "#1e6b34" if result.passed else "#a4161a"
            display(w.HTML(f"<b style='color:{colour}'>{_esc(self.shown['Port'])}</b>"))
            if result.timing:
                timing = result.timing
                self.shown["Port"] += (f"; port {timing['port_ms']:.3f} ms vs FlexAttention {timing['flex_ms']:.3f} ms "
                                       f"({timing['speed_vs_flex']:.2f}x)")
                display(w.HTML(_esc(self.shown["Port"].split("; ")[-1])))

    def _ipython_display_(self):
        display(self.widget)


def _show_png(fig) -> bytes:
    png = _png(fig)
    display(w.Image(value=png, format="png"))
    return png


def _esc(text: str) -> str:
    import html

    return html.escape(str(text))
