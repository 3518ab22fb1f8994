package lab

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

var metav1ListAll = metav1.ListOptions{}

func detachLoop(dev string) error {
	out, err := exec.Command("losetup", "-d", dev).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// startFaults starts the fault knobs that act over time; they stop with ctx.
func (r *run) startFaults(ctx context.Context, wg *sync.WaitGroup) {
	c := &r.c
	rnd := rand.New(rand.NewPCG(c.Seed, c.Seed^0xfa417))
	var mu sync.Mutex
	intn := func(n int) int {
		mu.Lock()
		defer mu.Unlock()
		return rnd.IntN(n)
	}
	float := func() float64 {
		mu.Lock()
		defer mu.Unlock()
		return rnd.Float64()
	}
	every := func(d time.Duration, f func()) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(d)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					f()
				}
			}
		}()
	}
	sleep := func(d time.Duration) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(d):
			return true
		}
	}
	if c.ControllerKillEvery > 0 {
		every(c.ControllerKillEvery, func() {
			p := r.g.Controller()
			r.log.Info("fault: killing the driver's controller process (SIGKILL)", "starts", p.Starts())
			if err := p.Kill(); err != nil {
				r.log.Error(err, "fault: kill failed")
			}
		})
	}
	if c.APIPause > 0 && c.APIPauseEvery > 0 {
		every(c.APIPauseEvery, func() {
			pids := pidsOf("kube-apiserver", filepath.Join(c.Out, "host", "control-plane"))
			if len(pids) == 0 {
				r.log.Info("fault: host kube-apiserver not found, not pausing")
				return
			}
			r.log.Info("fault: pausing the host kube-apiserver (SIGSTOP)", "for", c.APIPause, "pids", pids)
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGSTOP)
			}
			// Resume even when the run ends meanwhile.
			select {
			case <-ctx.Done():
			case <-time.After(c.APIPause):
			}
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGCONT)
			}
			r.log.Info("fault: host kube-apiserver resumed (SIGCONT)")
		})
	}
	if c.AttachPodStuck > 0 {
		period := c.AttachPodStuckEvery
		if period <= 0 {
			period = 4 * c.AttachPodStuck
		}
		every(period, func() {
			vm := r.nodes[intn(len(r.nodes))]
			r.log.Info("fault: attachment pods stuck", "vm", vm, "for", c.AttachPodStuck)
			r.h.Sim.Faults().SetAttachmentPodsStuck(r.h.Namespace, vm, true)
			sleep(c.AttachPodStuck)
			r.h.Sim.Faults().SetAttachmentPodsStuck(r.h.Namespace, vm, false)
		})
	}
	if c.WebhookOutage > 0 && r.h.Harvester != nil {
		period := c.WebhookOutageEvery
		if period <= 0 {
			period = 4 * c.WebhookOutage
		}
		every(period, func() {
			r.log.Info("fault: Harvester's webhook service away (every VM write fails calling it)", "for", c.WebhookOutage)
			r.h.Harvester.Down()
			sleep(c.WebhookOutage)
			if err := r.h.Harvester.Up(); err != nil {
				r.log.Error(err, "fault: Harvester's webhook service did not come back")
			}
		})
	}
	if c.DenyHotplug > 0 {
		// Each volume is denied with probability p for a few seconds at a
		// time: about that fraction of hotplug attempts meet the webhook.
		hold := max(time.Second, c.scaled(10*time.Second))
		every(hold, func() {
			pvs, err := r.g.Kube.CoreV1().PersistentVolumes().List(ctx, metav1ListAll)
			if err != nil {
				return
			}
			var denied []string
			for _, pv := range pvs.Items {
				if float() < c.DenyHotplug {
					r.h.Sim.Faults().DenyVolume(pv.Name, "lab fault: hotplug denied by policy")
					denied = append(denied, pv.Name)
				}
			}
			if len(denied) > 0 {
				r.log.Info("fault: hotplug webhook denies volumes", "volumes", denied, "for", hold)
			}
			sleep(hold)
			for _, v := range denied {
				r.h.Sim.Faults().AllowVolume(v)
			}
		})
	}
	r.startHostFaults(ctx, every, intn)
	r.startMigrations(ctx, every)
	r.startDrains(ctx, every)
}

// KillLeftovers kills every process whose command line mentions dir (a run
// directory): what a lab killed outright left running (its kubelets and
// driver processes die with it; the control planes' processes do not).
func KillLeftovers(dir string) []int {
	var killed []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		if strings.Contains(string(cmd), dir+"/") && syscall.Kill(pid, syscall.SIGKILL) == nil {
			killed = append(killed, pid)
		}
	}
	return killed
}

// WaitGone waits until none of pids exists any more, at most for d.
func WaitGone(pids []int, d time.Duration) {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		alive := false
		for _, pid := range pids {
			if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid))); err == nil {
				alive = true
			}
		}
		if !alive {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// pidsOf finds the processes running binary name whose command line
// mentions dir.
func pidsOf(name, dir string) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(cmd), "\x00")
		if len(args) > 0 && filepath.Base(args[0]) == name && strings.Contains(string(cmd), dir) {
			out = append(out, pid)
		}
	}
	return out
}
