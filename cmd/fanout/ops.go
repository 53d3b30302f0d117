package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/opsserver"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
)

// startOps serves /metrics, /livez and /readyz on http.addr (if set); the
// returned stop shuts it down.
func startOps(a *app, reg *prometheus.Registry, checks []opsserver.Check) (stop func(), err error) {
	if a.cfg.HTTP.Addr == "" {
		return func() {}, nil
	}
	srv, err := opsserver.Start(a.cfg.HTTP.Addr, reg, checks, logging.Component(a.logger, "http"))
	if err != nil {
		return nil, fmt.Errorf("http.addr %s: %w", a.cfg.HTTP.Addr, err)
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}

func natsCheck(nc *nats.Conn) opsserver.Check {
	return opsserver.Check{Name: "nats", Fn: func(context.Context) error {
		if !nc.IsConnected() {
			return fmt.Errorf("not connected (%s)", nc.Status())
		}
		return nil
	}}
}

func healthcheckCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "healthcheck",
		Short: "Ask this role's /readyz (http.addr) and exit 0 if ready: a probe for images without a shell",
		Args:  cobra.NoArgs,
		RunE: a.loaded(func(cmd *cobra.Command, _ []string) error {
			if a.cfg.HTTP.Addr == "" {
				return errors.New("http.addr is empty: the operations endpoint is disabled")
			}
			host, port, _ := net.SplitHostPort(a.cfg.HTTP.Addr)
			if host == "" || host == "0.0.0.0" || host == "::" {
				host = "127.0.0.1"
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 3*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(host, port)+"/readyz", nil)
			if err != nil {
				return err
			}
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			defer res.Body.Close()
			if res.StatusCode != http.StatusOK {
				return fmt.Errorf("not ready: %s", res.Status)
			}
			fmt.Fprintln(cmd.OutOrStdout(), "ready")
			return nil
		}),
	}
}

// untilStopOrClosed waits for SIGTERM (ctx) or for nc to be closed for
// good. nats.go reconnects forever, but gives up on errors it deems fatal
// (the server dropping it for a protocol violation, say); a role that kept
// running then would look alive and do nothing. So that is an error: the
// process exits non-zero and its supervisor restarts it.
func untilStopOrClosed(ctx context.Context, nc *nats.Conn) error {
	closed := make(chan struct{})
	var once sync.Once
	nc.SetClosedHandler(func(*nats.Conn) { once.Do(func() { close(closed) }) })
	if nc.IsClosed() {
		once.Do(func() { close(closed) })
	}
	select {
	case <-ctx.Done():
		return nil
	case <-closed:
		return fmt.Errorf("the NATS connection was closed for good (last error: %v); exiting so that the role is restarted", nc.LastError())
	}
}
