package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/harvester-csi/harvester-csi-driver/pkg/diagnose"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// runDiagnose is `harvester-csi-driver diagnose`: a read-only cross-check of
// the guest's VolumeAttachments, the host's VMs and VMIs and the controller's
// queue. It prints one line per finding and exits 1 when there is any
// disagreement, 0 when there is none (informational findings do not count)
// and 2 when it could not look.
func runDiagnose(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("harvester-csi-driver diagnose", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	kubeconfig := fs.String("kubeconfig", "", "host (Harvester) kubeconfig, as for the driver (fallback "+host.DefaultKubeconfig+")")
	guestKubeconfig := fs.String("guest-kubeconfig", "", "guest cluster kubeconfig (default: the in-cluster config when run in a pod; none: guest checks are skipped)")
	controller := fs.String("controller", "", "base URL of the controller's --metrics-address, e.g. http://127.0.0.1:9809, to read its queue (empty: skipped)")
	slowAfter := fs.Duration("slow-after", 2*time.Minute, "report waits and detaching VolumeAttachments older than this")
	timeout := fs.Duration("timeout", 30*time.Second, "give up reading after this long")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stdout, "Usage: harvester-csi-driver diagnose [--kubeconfig F] [--guest-kubeconfig F] [--controller URL] [--slow-after D]")
			fs.SetOutput(stdout)
			fs.PrintDefaults()
			return diagnose.ExitClean
		}
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
		return diagnose.ExitCannotLook
	}
	path, _, err := host.ResolveKubeconfig(*kubeconfig, host.DefaultKubeconfig)
	if err != nil {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: --kubeconfig: %v\n", err)
		return diagnose.ExitCannotLook
	}
	hc, err := host.Load(path, 20, 40)
	if err != nil {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
		return diagnose.ExitCannotLook
	}
	src := diagnose.Sources{Host: hc, Controller: *controller, Driver: driver.Name}
	notes := []string{}
	switch cfg, err := guestConfig(*guestKubeconfig); {
	case err != nil:
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: --guest-kubeconfig: %v\n", err)
		return diagnose.ExitCannotLook
	case cfg == nil:
		notes = append(notes, "no guest kubeconfig: VolumeAttachments not checked")
	default:
		if src.Guest, err = kubernetes.NewForConfig(cfg); err != nil {
			fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
			return diagnose.ExitCannotLook
		}
	}
	if *controller == "" {
		notes = append(notes, "no --controller: the driver's queue not checked")
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	in, err := diagnose.Gather(ctx, src)
	if err != nil {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
		return diagnose.ExitCannotLook
	}
	in.SlowAfter = *slowAfter
	in.Notes = append(notes, in.Notes...)
	return diagnose.Report(stdout, in, diagnose.Check(in))
}

// guestConfig is the guest cluster's client config: the given kubeconfig,
// else the in-cluster config, else nil.
func guestConfig(path string) (*rest.Config, error) {
	if path != "" {
		return clientcmd.BuildConfigFromFlags("", path)
	}
	cfg, err := rest.InClusterConfig()
	if errors.Is(err, rest.ErrNotInCluster) {
		return nil, nil
	}
	return cfg, err
}
