// Command chartctl renders, lints and packages the chart with the Helm Go SDK
// (no helm binary needed). Used by the Makefile:
//
//	chartctl manifests        rewrite deploy/harvester-csi-driver.yaml
//	chartctl lint             helm lint --strict with default and ci/*-values.yaml
//	chartctl package DIR      write the chart archive into DIR
//	chartctl images           list the images of the default values
//	chartctl release DIR VERSION [URL]
//	                          check that the chart carries VERSION, lint, package into DIR,
//	                          write DIR/index.yaml (chart URLs under URL) and DIR/images.txt
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "chartctl:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("usage: chartctl manifests | lint | package DIR | images | release DIR VERSION [URL]")
	}
	switch args[0] {
	case "manifests":
		b, err := render.DeployManifests()
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(render.DeployFile()), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(render.DeployFile(), b, 0o644); err != nil {
			return err
		}
		fmt.Println("wrote", render.DeployFile())
		return nil
	case "lint":
		return lint()
	case "package":
		if len(args) != 2 {
			return fmt.Errorf("usage: chartctl package DIR")
		}
		path, err := render.Package(render.ChartDir(), args[1])
		if err != nil {
			return err
		}
		fmt.Println("wrote", path)
		return nil
	case "images":
		ch, err := render.Load(render.ChartDir())
		if err != nil {
			return err
		}
		images, err := render.Images(ch, nil)
		if err != nil {
			return err
		}
		for _, img := range images {
			fmt.Println(img)
		}
		return nil
	case "release":
		if len(args) < 3 || len(args) > 4 {
			return fmt.Errorf("usage: chartctl release DIR VERSION [URL]")
		}
		url := ""
		if len(args) == 4 {
			url = args[3]
		}
		if err := lint(); err != nil {
			return err
		}
		written, err := render.Release(render.ChartDir(), args[1], args[2], url)
		if err != nil {
			return err
		}
		for _, f := range written {
			fmt.Println("wrote", f)
		}
		return nil
	}
	return fmt.Errorf("unknown command %q", args[0])
}

// lint runs `helm lint --strict` with the default values and with every
// ci/*-values.yaml.
func lint() error {
	files, err := filepath.Glob(filepath.Join(render.ChartDir(), "ci", "*-values.yaml"))
	if err != nil {
		return err
	}
	for _, f := range append([]string{""}, files...) {
		vals, err := render.ValuesFile(f)
		if err != nil {
			return err
		}
		if _, err := render.Lint(render.ChartDir(), vals); err != nil {
			return fmt.Errorf("values %q: %w", f, err)
		}
		name := f
		if name == "" {
			name = "default values"
		}
		fmt.Println("lint ok:", name)
	}
	return nil
}
