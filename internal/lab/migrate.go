package lab

import (
	"context"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// migrator live-migrates one VM and waits for the migration to end.
type migrator interface {
	migrate(ctx context.Context, vm string) (string, error)
	finished(ctx context.Context, vm, migration string) (phase kubevirtv1.VirtualMachineInstanceMigrationPhase, done bool)
}

// startMigrations is the --migrate-vms fault: every period the guest VMs
// live-migrate to another host node one after another, each waited for
// before the next, as a Harvester upgrade drains host node after host node
// (each VM there moves by a VirtualMachineInstanceMigration), on the
// simulated control plane or KubeVirt's real one alike.
func (r *run) startMigrations(ctx context.Context, every func(time.Duration, func())) {
	if r.c.MigrateVMsEvery <= 0 || r.h == nil {
		return
	}
	m := hostMigrator{r: r}
	every(r.c.MigrateVMsEvery, func() {
		r.log.Info("fault: live-migrating every guest VM in turn", "vms", len(r.nodes))
		failed := 0
		migrateInTurn(ctx, m, r.nodes, r.c.scaled(time.Second), func(vm string, err error) {
			failed++
			r.log.Error(err, "fault: live migration failed", "vm", vm)
		})
		if ctx.Err() == nil {
			// The run's log says how many moved, for the report.
			r.log.Info("fault: live migration round done", "vms", len(r.nodes), "failed", failed)
		}
	})
}

// migrateInTurn migrates each VM and waits for its migration to end before
// the next; a VM whose migration cannot start or fails is reported and
// skipped. It returns early when ctx ends.
func migrateInTurn(ctx context.Context, m migrator, vms []string, poll time.Duration, report func(vm string, err error)) {
	for _, vm := range vms {
		name, err := m.migrate(ctx, vm)
		if err != nil {
			if ctx.Err() != nil || pastDeadline(ctx) {
				return
			}
			report(vm, err)
			continue
		}
		var phase kubevirtv1.VirtualMachineInstanceMigrationPhase
		err = wait.PollUntilContextCancel(ctx, poll, true, func(ctx context.Context) (bool, error) {
			p, done := m.finished(ctx, vm, name)
			phase = p
			return done, nil
		})
		if err != nil {
			return // ctx ended
		}
		if phase != kubevirtv1.MigrationSucceeded {
			report(vm, fmt.Errorf("migration %s ended %s", name, phase))
		}
	}
}

// pastDeadline reports whether ctx's deadline has come or is about to: a
// round whose tick falls on the run's end gets the client rate limiter's
// refusal to wait past the deadline ("rate: Wait(n=1) would exceed context
// deadline"), which comes up to one request interval before the deadline
// and before ctx is done. That is the run ending, not a failed migration.
func pastDeadline(ctx context.Context) bool {
	dl, ok := ctx.Deadline()
	return ok && time.Until(dl) < deadlineMargin
}

// deadlineMargin is longer than the host client's wait for one request at
// any rate the lab gives it.
const deadlineMargin = time.Second

// hostMigrator migrates through the host's KubeVirt, simulated or real.
type hostMigrator struct{ r *run }

func (m hostMigrator) migrate(ctx context.Context, vm string) (string, error) {
	return m.r.h.Migrate(ctx, vm)
}

func (m hostMigrator) finished(ctx context.Context, _, migration string) (kubevirtv1.VirtualMachineInstanceMigrationPhase, bool) {
	mig, ok := m.r.h.Migration(ctx, migration)
	if !ok {
		return "", false
	}
	return mig.Status.Phase, mig.IsFinal()
}
