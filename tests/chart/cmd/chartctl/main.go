// Command chartctl renders, lints and packages the chart with the Helm Go SDK
// (no helm binary needed). Used by the Makefile:
//
//	chartctl manifests        rewrite deploy/harvester-csi-driver.yaml
//	chartctl lint             helm lint --strict with default and ci/*-values.yaml
//	chartctl package DIR      write the chart archive into DIR
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
		return fmt.Errorf("usage: chartctl manifests | lint | package DIR")
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
	}
	return fmt.Errorf("unknown command %q", args[0])
}
