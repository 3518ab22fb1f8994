package main

import (
	"strings"
	"testing"
	"time"
)

func TestUpstreamFlagsAndEnvironment(t *testing.T) {
	t.Setenv("HOST_STORAGE_CLASS", "longhorn-ssd")
	t.Setenv("DEBUG", "true")
	o, err := parseFlags([]string{"--endpoint=unix:///csi/other.sock", "--nodeid=vm-1", "--kubeconfig=/var/lib/harvester/cloud-provider-config"})
	if err != nil {
		t.Fatal(err)
	}
	if o.endpoint != "unix:///csi/other.sock" || o.nodeID != "vm-1" || o.kubeconfig != "/var/lib/harvester/cloud-provider-config" {
		t.Errorf("flags not taken: %+v", o)
	}
	if o.hostStorageClass != "longhorn-ssd" || !o.debug {
		t.Errorf("environment defaults not taken: class %q debug %v", o.hostStorageClass, o.debug)
	}
	o, err = parseFlags([]string{"--host-storage-class=explicit", "--batch-window=1s", "--mode=controller"})
	if err != nil {
		t.Fatal(err)
	}
	if o.hostStorageClass != "explicit" || o.queue.BatchWindow != time.Second || o.mode != "controller" {
		t.Errorf("flag must beat the environment and queue flags must apply: %+v", o)
	}
}

func TestDefaults(t *testing.T) {
	t.Setenv("HOST_STORAGE_CLASS", "")
	t.Setenv("DEBUG", "")
	o, err := parseFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if o.endpoint != "unix:///csi/csi.sock" || o.mode != "all" || o.backend != "auto" || o.debug {
		t.Errorf("defaults: %+v", o)
	}
	// The guard waits as long as the attach/detach controller's own force
	// detach bound; the guest client is the pod's own; the monitor runs.
	if o.detachGuardTimeout != 6*time.Minute || o.guestKubeconfig != "" || !o.nodeMonitor {
		t.Errorf("guest defaults: guard %s, guest kubeconfig %q, monitor %v", o.detachGuardTimeout, o.guestKubeconfig, o.nodeMonitor)
	}
}

func TestGuestFlags(t *testing.T) {
	o, err := parseFlags([]string{"--guest-kubeconfig=/etc/guest.yaml", "--detach-guard-timeout=0", "--node-monitor=false"})
	if err != nil {
		t.Fatal(err)
	}
	if o.guestKubeconfig != "/etc/guest.yaml" || o.detachGuardTimeout != 0 || o.nodeMonitor {
		t.Errorf("guest flags not taken: %+v", o)
	}
}

func TestBadCommandLinesAreClearErrors(t *testing.T) {
	for args, want := range map[string]string{
		"--no-such-flag":             "no-such-flag",
		"--mode=everything":          "invalid --mode",
		"stray":                      "unexpected arguments",
		"--batch-window=x":           "batch-window",
		"--detach-guard-timeout=-1s": "invalid --detach-guard-timeout",
	} {
		_, err := parseFlags([]string{args})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want an error mentioning %q", args, err, want)
		}
	}
}
