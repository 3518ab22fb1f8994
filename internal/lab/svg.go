package lab

import (
	"fmt"
	"image/color"
	"os"

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
	attachColor = color.RGBA{R: 31, G: 119, B: 180, A: 255}
	detachColor = color.RGBA{R: 214, G: 39, B: 40, A: 255}
)

// writeLatencySVG draws attach and detach latency over the run (each
// VolumeAttachment at the moment it finished) above the number of
// VolumeAttachments in flight.
func writeLatencySVG(path string, rep *Report) error {
	lat := plot.New()
	lat.Title.Text = fmt.Sprintf("VolumeAttachment latency (guest view), KubeVirt %s, time scale %g", rep.Config.KubeVirt, rep.Config.TimeScale)
	lat.X.Label.Text = "seconds since start"
	lat.Y.Label.Text = "latency (s)"
	lat.Add(plotter.NewGrid())
	for _, s := range []struct {
		name    string
		samples []monitor.Sample
		c       color.Color
		shape   draw.GlyphDrawer
	}{
		{"attach (created -> attached)", rep.AttachSamples, attachColor, draw.CircleGlyph{}},
		{"detach (deleted -> gone)", rep.DetachSamples, detachColor, draw.TriangleGlyph{}},
	} {
		if len(s.samples) == 0 {
			continue
		}
		pts := make(plotter.XYs, len(s.samples))
		for i, p := range s.samples {
			pts[i].X, pts[i].Y = p.At.Sub(rep.Started).Seconds(), p.Seconds
		}
		sc, err := plotter.NewScatter(pts)
		if err != nil {
			return err
		}
		sc.GlyphStyle.Color, sc.GlyphStyle.Shape, sc.GlyphStyle.Radius = s.c, s.shape, vg.Points(2)
		lat.Add(sc)
		lat.Legend.Add(s.name, sc)
	}
	lat.Legend.Top = true

	fl := plot.New()
	fl.X.Label.Text = "seconds since start"
	fl.Y.Label.Text = "in flight"
	fl.Add(plotter.NewGrid())
	if len(rep.InFlight) > 0 {
		att, det := make(plotter.XYs, len(rep.InFlight)), make(plotter.XYs, len(rep.InFlight))
		for i, f := range rep.InFlight {
			att[i].X, att[i].Y = f.Seconds, float64(f.Attaching)
			det[i].X, det[i].Y = f.Seconds, float64(f.Detaching)
		}
		for _, l := range []struct {
			name string
			xy   plotter.XYs
			c    color.Color
		}{{"attaching", att, attachColor}, {"detaching", det, detachColor}} {
			line, err := plotter.NewLine(l.xy)
			if err != nil {
				return err
			}
			line.Color = l.c
			fl.Add(line)
			fl.Legend.Add(l.name, line)
		}
	}
	fl.Legend.Top = true
	// One time axis for both panels.
	fl.X.Min, fl.X.Max = min(fl.X.Min, lat.X.Min), max(fl.X.Max, lat.X.Max)
	lat.X.Min, lat.X.Max = fl.X.Min, fl.X.Max

	const w, h = 28 * vg.Centimeter, 18 * vg.Centimeter
	canvas := vgsvg.New(w, h)
	dc := draw.New(canvas)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Millimeter, PadY: 4 * vg.Millimeter, PadTop: 2 * vg.Millimeter, PadBottom: 2 * vg.Millimeter, PadLeft: 2 * vg.Millimeter, PadRight: 2 * vg.Millimeter}
	plots := [][]*plot.Plot{{lat}, {fl}}
	canvases := plot.Align(plots, tiles, dc)
	lat.Draw(canvases[0][0])
	fl.Draw(canvases[1][0])
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
