package lab

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

// InFlight is the number of VolumeAttachments attaching and detaching at a
// moment.
type InFlight struct {
	Seconds   float64 `json:"seconds"`
	Attaching int     `json:"attaching"`
	Detaching int     `json:"detaching"`
}

var (
	attachColor   = color.RGBA{R: 31, G: 119, B: 180, A: 255}
	detachColor   = color.RGBA{R: 214, G: 39, B: 40, A: 255}
	comparedColor = color.RGBA{R: 255, G: 127, B: 14, A: 255}
)

// points is one scatter series of latency samples.
type points struct {
	name    string
	samples []monitor.Sample
	start   time.Time
	c       color.Color
	shape   draw.GlyphDrawer
}

// line is one line series of in-flight counts.
type line struct {
	name string
	xy   plotter.XYs
	c    color.Color
	dash bool
}

// writeLatencySVG draws attach and detach latency over the run (each
// VolumeAttachment at the moment it finished) above the number of
// VolumeAttachments in flight.
func writeLatencySVG(path string, rep *Report) error {
	lat, err := scatterPanel(fmt.Sprintf("VolumeAttachment latency (guest view), KubeVirt %s, time scale %g", rep.Config.KubeVirt, rep.Config.TimeScale), []points{
		{"attach (created -> attached)", rep.AttachSamples, rep.Started, attachColor, draw.CircleGlyph{}},
		{"detach (deleted -> gone)", rep.DetachSamples, rep.Started, detachColor, draw.TriangleGlyph{}},
	})
	if err != nil {
		return err
	}
	att, det := inFlightLines(rep)
	fl, err := linePanel([]line{{"attaching", att, attachColor, false}, {"detaching", det, detachColor, false}})
	if err != nil {
		return err
	}
	return drawPanels(path, lat, fl)
}

// WriteCompareSVG draws two runs of one scenario in one figure: attach and
// detach latency of both over the run, and both runs' VolumeAttachments in
// flight.
func WriteCompareSVG(path string, a, b *Report) error {
	title := func(what string) string {
		return fmt.Sprintf("%s latency: this driver (%s) and compared (%s), KubeVirt %s", what, filepath.Base(a.Driver.Binary), filepath.Base(b.Driver.Binary), a.Config.KubeVirt)
	}
	att, err := scatterPanel(title("attach"), []points{
		{"this driver: attach", a.AttachSamples, a.Started, attachColor, draw.CircleGlyph{}},
		{"compared: attach", b.AttachSamples, b.Started, comparedColor, draw.TriangleGlyph{}},
	})
	if err != nil {
		return err
	}
	det, err := scatterPanel(title("detach"), []points{
		{"this driver: detach", a.DetachSamples, a.Started, attachColor, draw.CircleGlyph{}},
		{"compared: detach", b.DetachSamples, b.Started, comparedColor, draw.TriangleGlyph{}},
	})
	if err != nil {
		return err
	}
	total := func(rep *Report) plotter.XYs {
		xy := make(plotter.XYs, len(rep.InFlight))
		for i, f := range rep.InFlight {
			xy[i].X, xy[i].Y = f.Seconds, float64(f.Attaching+f.Detaching)
		}
		return xy
	}
	fl, err := linePanel([]line{{"this driver: attaching + detaching", total(a), attachColor, false}, {"compared: attaching + detaching", total(b), comparedColor, true}})
	if err != nil {
		return err
	}
	return drawPanels(path, att, det, fl)
}

func inFlightLines(rep *Report) (att, det plotter.XYs) {
	att, det = make(plotter.XYs, len(rep.InFlight)), make(plotter.XYs, len(rep.InFlight))
	for i, f := range rep.InFlight {
		att[i].X, att[i].Y = f.Seconds, float64(f.Attaching)
		det[i].X, det[i].Y = f.Seconds, float64(f.Detaching)
	}
	return att, det
}

func scatterPanel(title string, series []points) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "seconds since start"
	p.Y.Label.Text = "latency (s)"
	p.Add(plotter.NewGrid())
	for _, s := range series {
		if len(s.samples) == 0 {
			continue
		}
		pts := make(plotter.XYs, len(s.samples))
		for i, sm := range s.samples {
			pts[i].X, pts[i].Y = sm.At.Sub(s.start).Seconds(), sm.Seconds
		}
		sc, err := plotter.NewScatter(pts)
		if err != nil {
			return nil, err
		}
		sc.GlyphStyle.Color, sc.GlyphStyle.Shape, sc.GlyphStyle.Radius = s.c, s.shape, vg.Points(2)
		p.Add(sc)
		p.Legend.Add(s.name, sc)
	}
	legendTopLeft(p)
	return p, nil
}

func linePanel(lines []line) (*plot.Plot, error) {
	p := plot.New()
	p.X.Label.Text = "seconds since start"
	p.Y.Label.Text = "VolumeAttachments in flight"
	p.Y.Tick.Marker = wholeTicks{}
	p.Add(plotter.NewGrid())
	for _, l := range lines {
		if len(l.xy) == 0 {
			continue
		}
		pl, err := plotter.NewLine(l.xy)
		if err != nil {
			return nil, err
		}
		pl.Color = l.c
		if l.dash {
			pl.Dashes = []vg.Length{vg.Points(4), vg.Points(2)}
		}
		p.Add(pl)
		p.Legend.Add(l.name, pl)
	}
	legendTopLeft(p)
	return p, nil
}

// legendTopLeft puts the legend in the top left corner, clear of the right
// edge its text would run past, above the data: the y axis gets a third
// more room on top for it.
func legendTopLeft(p *plot.Plot) {
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs = vg.Millimeter
	if p.Y.Max > p.Y.Min {
		p.Y.Max += (p.Y.Max - p.Y.Min) / 3
	}
}

// wholeTicks marks only whole numbers: a count of VolumeAttachments has no
// fractions.
type wholeTicks struct{}

func (wholeTicks) Ticks(lo, hi float64) []plot.Tick {
	lo, hi = math.Floor(lo), math.Ceil(hi)
	step := math.Max(1, math.Ceil((hi-lo)/5))
	var ticks []plot.Tick
	for v := lo; v <= hi; v += step {
		ticks = append(ticks, plot.Tick{Value: v, Label: fmt.Sprintf("%.0f", v)})
	}
	return ticks
}

// drawPanels stacks the panels on one time axis and writes the SVG with its
// fonts embedded: the legend and labels are laid out with the font's
// metrics, and a viewer substituting another font would cut them off.
func drawPanels(path string, panels ...*plot.Plot) error {
	xmin, xmax := math.Inf(1), math.Inf(-1)
	for _, p := range panels {
		xmin, xmax = math.Min(xmin, p.X.Min), math.Max(xmax, p.X.Max)
	}
	rows := make([][]*plot.Plot, len(panels))
	for i, p := range panels {
		p.X.Min, p.X.Max = xmin, xmax
		rows[i] = []*plot.Plot{p}
	}
	w, h := 28*vg.Centimeter, vg.Length(len(panels))*9*vg.Centimeter
	canvas := vgsvg.NewWith(vgsvg.UseWH(w, h), vgsvg.EmbedFonts(true))
	tiles := draw.Tiles{Rows: len(panels), Cols: 1, PadX: vg.Millimeter, PadY: 4 * vg.Millimeter, PadTop: 2 * vg.Millimeter, PadBottom: 2 * vg.Millimeter, PadLeft: 2 * vg.Millimeter, PadRight: 4 * vg.Millimeter}
	canvases := plot.Align(rows, tiles, draw.New(canvas))
	for i, p := range panels {
		p.Draw(canvases[i][0])
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := canvas.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
